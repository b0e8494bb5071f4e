"""A static cache (`make_static`, what CUDA graph decoding runs on) decodes what a growing cache decodes, and its
steps are replayable: each step dispatches the same ops with the same shapes and arguments, reads nothing back
to the host and keeps every cache tensor at its address. The GPU replay itself is checked in gpu/test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_factory import random_model, tiny_config
from modeling_deepseek_v41.cache import DeepseekV41Cache

PROMPT, STEPS = 34, 6
HOST_READS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive", "item"}


def _prefilled(model, ids: torch.Tensor, padding: int = 0) -> DeepseekV41Cache:
    """A cache holding the prompt; with `padding`, the second row's first tokens are left padding."""
    cache = DeepseekV41Cache(model.config)
    mask = torch.ones(ids.shape[0], PROMPT, dtype=torch.long)
    mask[1:, :padding] = 0
    model(input_ids=ids[:, :PROMPT], attention_mask=mask if padding else None, cache=cache)
    return cache


def _steps(model, cache: DeepseekV41Cache, ids: torch.Tensor) -> list[torch.Tensor]:
    return [model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(PROMPT, PROMPT + STEPS)]


@pytest.mark.parametrize("paths,padding", [("cpu", 0), ("accelerator", 0), ("accelerator", 5)])
def test_static_cache_decodes_like_a_growing_cache(paths, padding, request):
    if paths == "accelerator":
        request.getfixturevalue("accelerator_paths")
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        growing = _steps(model, _prefilled(model, ids, padding), ids)
        cache = _prefilled(model, ids, padding)
        cache.make_static(PROMPT + STEPS)
        static = _steps(model, cache, ids)
        assert cache.columns == PROMPT + STEPS and int(cache.static_columns) == PROMPT + STEPS
        cache.end_static()
        model(input_ids=ids[:, :3], cache=cache)  # a growing cache again: any forward runs
    for got, want in zip(static, growing):
        # pools are read to their capacity, masked: the extra entries weigh exactly zero
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


class _Trace(TorchDispatchMode):
    """Every op a step dispatches, with its tensors' shapes and dtypes and its other arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def describe(value):
            if isinstance(value, torch.Tensor):
                return ("tensor", tuple(value.shape), value.dtype)
            if isinstance(value, (list, tuple)):
                return tuple(describe(v) for v in value)
            return value

        self.ops.append((func.__name__, describe(args), describe(sorted((kwargs or {}).items()))))
        return func(*args, **(kwargs or {}))


def _cache_tensors(cache: DeepseekV41Cache) -> dict[str, int]:
    """The address of every tensor the cache holds (records, rings, pools, carries, counters)."""
    found = {}

    def walk(name, value):
        if isinstance(value, torch.Tensor):
            found[name] = value.data_ptr()
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}[{k}]", v)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("modeling_deepseek_v41"):
            for k, v in vars(value).items():
                walk(f"{name}.{k}", v)

    for key, value in vars(cache).items():
        if key not in ("chunk_start", "text_config", "plan", "layers"):  # chunk_start lives within one step; layers are views of the cache
            walk(key, value)
    return found


def test_static_steps_are_replayable(accelerator_paths):
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = _prefilled(model, ids)
        cache.make_static(PROMPT + STEPS)
        model(input_ids=ids[:, PROMPT:PROMPT + 1], cache=cache)  # the eager first step (builds the expert stacks)
        addresses = _cache_tensors(cache)
        traces = []
        for t in (PROMPT + 1, PROMPT + 2):
            step_ids = ids[:, t:t + 1].clone()
            with _Trace() as trace:
                model(input_ids=step_ids, cache=cache)
            traces.append(trace.ops)
    assert traces[0] == traces[1]
    assert not [op for op in traces[0] if op[0].split(".")[0] in HOST_READS]
    assert _cache_tensors(cache) == addresses


def test_static_cache_refuses_what_it_cannot_replay():
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = DeepseekV41Cache(model.config)
    with pytest.raises(ValueError, match="prefilled cache"):
        cache.make_static(20)
    with torch.no_grad():
        model(input_ids=ids[:, :8], cache=cache)
        cache.make_static(9)
        with pytest.raises(ValueError, match="one-token decode steps"):
            model(input_ids=ids[:, 8:10], cache=cache)
        model(input_ids=ids[:, 8:9], cache=cache)
        with pytest.raises(ValueError, match="static cache is full"):
            model(input_ids=ids[:, 9:10], cache=cache)
    with pytest.raises(ValueError, match="end_static"):
        cache.crop(-1)


def test_generate_with_cuda_graphs_needs_a_cuda_model():
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(8))
    cache = DeepseekV41Cache(model.config)
    with pytest.raises(ValueError, match="CUDA device"):
        model.generate(ids, max_new_tokens=4, do_sample=False, cuda_graphs=True, cache=cache)
    assert cache.generation_run is None  # nothing of the refused call is left, on the cache or the model
