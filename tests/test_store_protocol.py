"""The store protocol (`layers/kv_store.py`): both stores implement it, the layers call only it, and a pool owner
makes two calls into its store per forward."""

from collections import Counter

import pytest
import torch
from model_factory import random_model, tiny_config

from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.cache.cache_store import CacheStore
from modeling_deepseek_v41.cache.chunk_store import ChunkStore
from modeling_deepseek_v41.layers.attention import DeepseekV41Attention
from modeling_deepseek_v41.layers.kv_store import DrafterRings, ForwardStore, KVStore, PoolView, WindowView

LAYER_CALLS = ("write_pool", "window")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), dtype=torch.float64, seed=4)


def _ids(model, length: int) -> torch.Tensor:
    vocab = model.config.text_config.vocab_size
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(5))


def test_both_stores_and_their_views_implement_the_protocol(model, monkeypatch):
    views = []
    for store_class in (CacheStore, ChunkStore):
        for name in LAYER_CALLS:
            def recorded(self, *args, _call=getattr(store_class, name), **kwargs):
                views.append(_call(self, *args, **kwargs))
                return views[-1]
            monkeypatch.setattr(store_class, name, recorded)
    cache = DeepseekV41Cache(model.config, dspark=True)
    with torch.no_grad():
        model(_ids(model, 20), cache=cache)
        model(_ids(model, 20)[:, :1], cache=cache)
        model(_ids(model, 20), use_cache=False)
    assert isinstance(CacheStore(cache), ForwardStore) and isinstance(ChunkStore(), ForwardStore)
    assert isinstance(CacheStore(cache), KVStore) and isinstance(cache, DrafterRings)
    pools = [v for v in views if not isinstance(v, WindowView)]
    assert pools and all(isinstance(v, PoolView) for v in pools)
    assert {type(v).__name__ for v in views} == {"StoredPoolView", "RingWindow", "DensePoolView", "ChunkWindow"}


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_a_pool_owner_calls_its_store_twice_per_forward(model, monkeypatch, use_cache):
    """Per forward, a Full layer writes its pool and its window; every other attention layer writes its window;
    the layers call nothing else on the store (the views they get back answer the rest)."""
    calls, current = Counter(), {"layer": None}
    store_class = CacheStore if use_cache else ChunkStore
    for name in [n for n in vars(store_class) if not n.startswith("_")]:
        original = getattr(store_class, name)
        if not callable(original):
            continue

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if current["layer"] is not None:
                calls[(current["layer"], _name)] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(store_class, name, counted)
    forward = DeepseekV41Attention.forward

    def attention(self, *args, **kwargs):
        current["layer"] = self.spec
        try:
            return forward(self, *args, **kwargs)
        finally:
            current["layer"] = None
    monkeypatch.setattr(DeepseekV41Attention, "forward", attention)
    cache = DeepseekV41Cache(model.config) if use_cache else None
    ids = _ids(model, 31)
    steps = [ids[:, :30], ids[:, 30:]] if use_cache else [ids]
    for step in steps:
        calls.clear()
        with torch.no_grad():
            model(step, cache=cache, use_cache=use_cache)
        for spec in model.plan.layers:
            expected = {"window": 1, "write_pool": 1} if spec.is_full else {"window": 1}
            assert {name: n for (layer, name), n in calls.items() if layer is spec} == expected, spec.layer_id


def test_a_long_chunk_lists_the_ring_as_it_was_before_writing(model):
    """A chunk longer than the ring's spare slots overwrites slots its first queries list: they read a copy of the
    ring as it was. Chunked prefill with a small crop horizon (few spare slots) equals one full forward."""
    ids = _ids(model, 60)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DeepseekV41Cache(model.config, crop_horizon=2)
        got = torch.cat([model(ids[:, a:b], cache=cache).logits for a, b in ((0, 17), (17, 40), (40, 41), (41, 60))],
                        dim=1)
    assert torch.allclose(got, full, rtol=1e-10, atol=1e-10)


def test_static_buffers_are_a_property_of_the_parts(model):
    """make_static fixes the cache's parts (the layers never ask); end_static releases them."""
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(_ids(model, 12), cache=cache)
    cache.make_static(20)
    assert cache.is_static and all(part.fixed for part in (*cache.pools.values(), *cache.rings.values()))
    assert all(pool.rows_after(0) == pool.kv.capacity for pool in cache.pools.values())
    cache.end_static()
    assert not cache.is_static and not any(part.fixed for part in (*cache.pools.values(), *cache.rings.values()))
