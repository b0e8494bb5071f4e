"""The store protocol (`layers/kv_store.py`): both stores and the cache's drafter rings implement it; the layers
reach their store only through its declared calls, once per layer and forward (a pool owner: `write_pool` and
`window`; every other attention layer: `window`; a drafter stage: `write_window` per forward, `drafter_window` per
draft); static decode is a property of the cache's parts."""

from collections import Counter

import pytest
import torch

import modeling_deepseek_v41.model.backbone as backbone
from model_factory import random_model, tiny_config
from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.cache.cache_store import CacheStore
from modeling_deepseek_v41.cache.chunk_store import ChunkStore
from modeling_deepseek_v41.layers.attention import DeepseekV41Attention
from modeling_deepseek_v41.layers.dspark import DeepseekV41DSpark
from modeling_deepseek_v41.layers.kv_store import DrafterRings, ForwardStore, KVStore, PoolView, WindowView
from modeling_deepseek_v41.model.generation.dspark import dspark_draft

LAYER_CALLS = {"write_pool", "window"}  # what an attention layer may reach on its store
DRAFTER_CALLS = {"write_window", "drafter_window"}


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), dtype=torch.float64, seed=4)


def _ids(model, length: int) -> torch.Tensor:
    vocab = model.config.text_config.vocab_size
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(5))


class Reached:
    """`target` behind a proxy that counts every attribute reached on it while `running["layer"]` is set (any name:
    a declared call, an undeclared one, a property) and each call in `by_id` by the layer id it names first."""

    def __init__(self, target, running: dict, reached: Counter, by_layer: Counter, by_id: set[str]) -> None:
        self._target, self._running, self._reached, self._by_layer, self._by_id = (target, running, reached,
                                                                                    by_layer, by_id)

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if self._running["layer"] is not None:
            self._reached[(self._running["layer"], name)] += 1
        if name not in self._by_id:
            return value

        def call(layer_id, *args, **kwargs):
            self._by_layer[(layer_id, name)] += 1
            return value(layer_id, *args, **kwargs)
        return call


@pytest.fixture
def counted(monkeypatch):
    """Every forward's store behind a `Reached` proxy; `running["layer"]` is the id of the attention layer (or
    "drafter") whose forward runs, `running["forward"]` the attention forward it runs. Returns (running, reached,
    by_layer), cleared by the caller between forwards."""
    running = {"layer": None, "forward": DeepseekV41Attention.forward}
    reached, by_layer = Counter(), Counter()
    forward_store = backbone.forward_store

    def counting_store(*args, **kwargs):
        cache, store, mode = forward_store(*args, **kwargs)
        return cache, Reached(store, running, reached, by_layer, LAYER_CALLS), mode
    monkeypatch.setattr(backbone, "forward_store", counting_store)
    feed_rings = DeepseekV41DSpark.feed_rings

    def attention_forward(self, *args, **kwargs):
        running["layer"] = self.spec.layer_id
        try:
            return running["forward"](self, *args, **kwargs)
        finally:
            running["layer"] = None

    def counted_feed_rings(self, taps, positions, rotations, rings):
        running["layer"] = "drafter"
        try:
            return feed_rings(self, taps, positions, rotations, Reached(rings, running, reached, by_layer,
                                                                        DRAFTER_CALLS))
        finally:
            running["layer"] = None
    monkeypatch.setattr(DeepseekV41Attention, "forward", attention_forward)
    monkeypatch.setattr(DeepseekV41DSpark, "feed_rings", counted_feed_rings)
    return running, reached, by_layer


def _expected_layer_calls(model) -> Counter:
    """Each attention layer's declared calls, once per forward."""
    expected = Counter()
    for spec in model.plan.layers:
        expected[(spec.layer_id, "window")] = 1
        if spec.is_full:
            expected[(spec.layer_id, "write_pool")] = 1
    return expected


def test_both_stores_and_the_drafter_rings_satisfy_the_protocols(model, monkeypatch):
    cache = DeepseekV41Cache(model.config, dspark=True)
    for store in (CacheStore(cache), ChunkStore()):
        assert isinstance(store, KVStore) and isinstance(store, ForwardStore)
    assert isinstance(cache, DrafterRings)
    # the checks are not vacuous: the cache is no store (the layers never write it directly), a ChunkStore holds
    # no drafter rings, and a store without the window call is no KVStore
    assert not isinstance(cache, KVStore) and not isinstance(ChunkStore(), DrafterRings)

    class NoWindow:
        def write_pool(self, source, positions, compress, dtype):
            raise AssertionError("never called")
    assert not isinstance(NoWindow(), KVStore)

    views = []
    for store_class in (CacheStore, ChunkStore):
        for name in LAYER_CALLS:
            def recorded(self, *args, _call=getattr(store_class, name), **kwargs):
                views.append(_call(self, *args, **kwargs))
                return views[-1]
            monkeypatch.setattr(store_class, name, recorded)
    with torch.no_grad():
        model(_ids(model, 20), cache=cache)
        model(_ids(model, 20)[:, :1], cache=cache)
        model(_ids(model, 20), use_cache=False)
    pools = [v for v in views if not isinstance(v, WindowView)]
    assert pools and all(isinstance(v, PoolView) for v in pools)
    assert {type(v).__name__ for v in views} == {"StoredPoolView", "RingWindow", "DensePoolView", "ChunkWindow"}


@pytest.mark.parametrize("run", ["cache", "cache_bounded_replay", "no_cache"])
def test_each_layer_makes_only_its_declared_calls_once_per_forward(model, counted, run):
    """Per forward, a Full layer writes its pool and its window, every other attention layer writes its window
    (counted by the layer id each call names, whoever calls: CED's bounded replay compresses the decoder's pool
    before its forward); while a layer runs it reaches nothing else on the store (its views answer the rest)."""
    running, reached, by_layer = counted
    ids = _ids(model, 41)
    cache = None if run == "no_cache" else DeepseekV41Cache(model.config)
    if run == "cache":
        steps = [dict(input_ids=ids[:, :40]), dict(input_ids=ids[:, 40:])]  # a prefill, a decode step
    elif run == "cache_bounded_replay":
        steps = [dict(input_ids=ids[:, :40], prefill_mode="bounded_replay")]
    else:
        steps = [dict(input_ids=ids, use_cache=False)]
    for step in steps:
        reached.clear()
        by_layer.clear()
        with torch.no_grad():
            model(**step, cache=cache)
        assert by_layer == _expected_layer_calls(model)
        assert {name for _, name in reached} <= LAYER_CALLS, sorted(reached)
        assert all(count == 1 for count in reached.values()), sorted(reached.items(), key=str)


def test_the_count_sees_an_undeclared_or_repeated_call(model, counted):
    """The count above can fail: a layer that also asks its store something else, or lists its window twice, is
    seen."""
    running, reached, by_layer = counted
    forward = running["forward"]

    def asking_layer(self, x, positions, rotation, inv_freq, share):
        share.store.get_seq_length()
        share.store.window(self.spec.layer_id, x.new_zeros(*x.shape[:2], self.head_dim), positions, self.window)
        return forward(self, x, positions, rotation, inv_freq, share)
    running["forward"] = asking_layer
    with torch.no_grad():
        model(_ids(model, 8), use_cache=False)
    first = model.plan.layers[0].layer_id
    assert reached[(first, "get_seq_length")] == 1 and by_layer[(first, "window")] == 2
    assert by_layer != _expected_layer_calls(model)


def test_the_drafter_feeds_each_stage_ring_once_per_forward_and_reads_it_once_per_draft(model, counted,
                                                                                         monkeypatch):
    running, reached, by_layer = counted
    read = Counter()
    drafter_window = DeepseekV41Cache.drafter_window

    def counted_read(self, layer_id, *args, **kwargs):
        read[layer_id] += 1
        return drafter_window(self, layer_id, *args, **kwargs)
    monkeypatch.setattr(DeepseekV41Cache, "drafter_window", counted_read)
    stages = [spec.layer_id for spec in model.plan.dspark_layers]
    cache, ids = DeepseekV41Cache(model.config, dspark=True), _ids(model, 21)
    for step in (ids[:, :20], ids[:, 20:]):
        reached.clear()
        by_layer.clear()
        with torch.no_grad():
            logits = model(step, cache=cache).logits
        assert {name for layer, name in reached if layer == "drafter"} == {"write_window"}, sorted(reached, key=str)
        assert by_layer == Counter({(stage, "write_window"): 1 for stage in stages}) + _expected_layer_calls(model)
    with torch.no_grad():
        dspark_draft(model, logits[:, -1].argmax(-1), cache)
    assert read == Counter({stage: 1 for stage in stages})


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
    assert cache.log.limit == 20 and all(pool.rows_after(0) == pool.kv.capacity for pool in cache.pools.values())
    cache.end_static()
    assert not cache.is_static and not any(part.fixed for part in (*cache.pools.values(), *cache.rings.values()))
