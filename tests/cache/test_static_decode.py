"""A static cache (`make_static`, what CUDA graph decoding runs on) decodes what a growing cache decodes, and its
steps are replayable: each step dispatches the same ops with the same shapes and arguments, reads nothing back
to the host and keeps every cache tensor at its address. The GPU replay itself is checked in gpu/test_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_factory import random_model, tiny_config
from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.model.generation.dspark import dspark_draft, greedy_verdict

PROMPT, STEPS = 34, 6
HOST_READS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive", "item"}


def _prefilled(model, ids: torch.Tensor, padding: int = 0, dspark: bool = False) -> DeepseekV41Cache:
    """A cache holding the prompt; with `padding`, the second row's first tokens are left padding."""
    cache = DeepseekV41Cache(model.config, dspark=dspark)
    mask = torch.ones(ids.shape[0], PROMPT, dtype=torch.long)
    mask[1:, :padding] = 0
    model(input_ids=ids[:, :PROMPT], attention_mask=mask if padding else None, cache=cache)
    return cache


def _steps(model, cache: DeepseekV41Cache, ids: torch.Tensor, widths=(1,) * STEPS, start: int = PROMPT
           ) -> list[torch.Tensor]:
    """The logits of steps of `widths` tokens each from column `start` on."""
    logits = []
    for width in widths:
        logits.append(model(input_ids=ids[:, start:start + width], cache=cache).logits)
        start += width
    return logits


@pytest.mark.parametrize("paths,padding,widths", [("cpu", 0, (1,) * STEPS), ("accelerator", 0, (1,) * STEPS),
                                                  ("accelerator", 5, (1,) * STEPS), ("cpu", 0, (4, 1, 1)),
                                                  ("accelerator", 5, (4, 1, 1))])
def test_static_cache_decodes_like_a_growing_cache(paths, padding, widths, request):
    """One-token steps, and steps of several tokens (a DSpark verify step: the drafts and the token before them)."""
    if paths == "accelerator":
        request.getfixturevalue("accelerator_paths")
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        growing = _steps(model, _prefilled(model, ids, padding), ids, widths)
        cache = _prefilled(model, ids, padding)
        cache.make_static(PROMPT + STEPS)
        static = _steps(model, cache, ids, widths)
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


def _mask_indexing(op: tuple) -> bool:
    """Whether a traced op indexes by a boolean mask: its output size depends on the mask's values (a device read
    a CUDA graph cannot replay), though the CPU's index kernel does that read below the dispatcher."""
    def has_bool(value) -> bool:
        if isinstance(value, tuple) and value[:1] == ("tensor",):
            return value[2] == torch.bool
        return isinstance(value, tuple) and any(has_bool(v) for v in value)

    return op[0].split(".")[0] in ("index", "index_put", "index_put_", "_index_put_impl_") and has_bool(op[1])


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


@pytest.mark.parametrize("width", [1, 6])
def test_static_steps_are_replayable(width, accelerator_paths):
    """One-token steps, and steps of several tokens (a DSpark verify step: the drafts and the token before them)."""
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + 3 * width), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = _prefilled(model, ids)
        cache.make_static(PROMPT + 3 * width)
        model(input_ids=ids[:, PROMPT:PROMPT + width], cache=cache)  # the eager first step (builds the stacks)
        addresses = _cache_tensors(cache)
        traces = []
        for t in (PROMPT + width, PROMPT + 2 * width):
            step_ids = ids[:, t:t + width].clone()
            with _Trace() as trace:
                model(input_ids=step_ids, cache=cache)
            traces.append(trace.ops)
    assert traces[0] == traces[1]
    assert not [op for op in traces[0] if op[0].split(".")[0] in HOST_READS or _mask_indexing(op)]
    assert _cache_tensors(cache) == addresses


def _discrete_state(cache: DeepseekV41Cache) -> dict[str, torch.Tensor]:
    """What decides which entries a cache's next forward reads: counts, cursor, every ring's slot positions."""
    state = {"lengths": cache.lengths.clone(), "columns": torch.tensor(cache.columns),
             "tokens": cache.log.tokens.view(0, cache.columns).clone(), "history": cache.history.clone()}
    state.update({f"ring{i}": ring.positions.clone() for i, ring in cache.rings.items()})
    return state


@pytest.mark.parametrize("dspark", [False, True])
def test_a_static_crop_rolls_back_rejected_drafts_in_place(dspark, accelerator_paths):
    """A verify step of six tokens of which the last four are rejected, then cropped: the static cache holds what a
    static cache that only ever saw the two accepted tokens holds, at the same addresses, and decodes and drafts
    as it does."""
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + 16), generator=torch.Generator().manual_seed(9))
    verify = ids[:, PROMPT:PROMPT + 6].clone()
    verify[:, 2:] = (verify[:, 2:] + 7) % 490 + 3  # rejected drafts: other tokens than the sequence goes on with
    with torch.no_grad():
        accepted_only = _prefilled(model, ids, dspark=dspark)
        accepted_only.make_static(PROMPT + 16)
        model(input_ids=ids[:, PROMPT:PROMPT + 2], cache=accepted_only)
        cache = _prefilled(model, ids, dspark=dspark)
        cache.make_static(PROMPT + 16)
        model(input_ids=verify, cache=cache)
        addresses = _cache_tensors(cache)
        cache.crop(-4)
        assert _cache_tensors(cache) == addresses and int(cache.static_columns) == PROMPT + 2
        want_state, got_state = _discrete_state(accepted_only), _discrete_state(cache)
        assert want_state.keys() == got_state.keys()
        for key in want_state:
            assert torch.equal(got_state[key], want_state[key]), key
        for pool, pool_want in zip(cache.pools.values(), accepted_only.pools.values()):
            if pool.ratio > 1:
                torch.testing.assert_close(pool.carry, pool_want.carry, rtol=1e-5, atol=1e-5)
        want = _steps(model, accepted_only, ids, (1, 1, 3), start=PROMPT + 2)
        got = _steps(model, cache, ids, (1, 1, 3), start=PROMPT + 2)
        if dspark:
            next_ids = want[-1][:, -1].argmax(-1)
            drafts = (dspark_draft(model, next_ids, cache), dspark_draft(model, next_ids, accepted_only))
    for got_logits, want_logits in zip(got, want):
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
    if dspark:
        assert torch.equal(drafts[0].ids, drafts[1].ids)
        torch.testing.assert_close(drafts[0].logits, drafts[1].logits, rtol=1e-5, atol=1e-5)


def test_static_drafting_rounds_are_replayable(accelerator_paths):
    """A DSpark round on a static cache (the draft, the verify step of the token and its drafts, the greedy verdict)
    dispatches the same ops with the same arguments on consecutive rounds, reads nothing back to the host and keeps
    every cache tensor at its address; only the crop of the rejected drafts needs the accepted count."""
    model = random_model(tiny_config(), dtype=torch.float32)
    block = model.config.text_config.dspark_block_size
    prompt = 4  # shorter than the window: the drafter's rings fill up over the rounds
    ids = torch.randint(3, 500, (1, prompt), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config, dspark=True)
        model(input_ids=ids[:, :-1], cache=cache)
        cache.make_static(prompt + 4 * (block + 1))
        next_ids = model(input_ids=ids[:, -1:].clone(), cache=cache).logits[:, -1].argmax(-1)
        traces, accepted = [], []
        for _ in range(3):  # the first round runs eagerly, as a graph's recording step would
            with _Trace() as trace:
                draft = dspark_draft(model, next_ids, cache)
                verdict = greedy_verdict(draft.ids, model(input_ids=draft.ids, cache=cache).logits)
            traces.append(trace.ops)
            addresses = _cache_tensors(cache)
            accepted.append(int(verdict.accepted))  # the round's one host read
            cache.crop(-(block - accepted[-1]))
            assert _cache_tensors(cache) == addresses
            next_ids = verdict.next_ids
    assert traces[1] == traces[2]
    assert not [op for op in traces[1] if op[0].split(".")[0] in HOST_READS or _mask_indexing(op)]
    assert cache.columns == prompt + sum(a + 1 for a in accepted)


def test_a_later_cache_replays_on_adopted_parts(accelerator_paths):
    """What lets generate(cuda_graphs=True) reuse an earlier call's recordings: a later cache (another prompt,
    another length) moves its state into the static buffers of an earlier one, then decodes and drafts bit for bit
    as a static cache of its own, dispatching the ops the earlier cache's steps dispatched, on the same tensors."""
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, PROMPT + 8), generator=torch.Generator().manual_seed(11))
    other = torch.randint(3, 500, (2, PROMPT + 4), generator=torch.Generator().manual_seed(12))
    capacity, later_prompt = PROMPT + 16, PROMPT - 6
    with torch.no_grad():
        first = _prefilled(model, ids, dspark=True)
        first.make_static(capacity)
        model(input_ids=ids[:, PROMPT:PROMPT + 1], cache=first)  # the eager first step
        earlier = []
        for t, width in ((PROMPT + 1, 1), (PROMPT + 2, 6)):
            chunk = ids[:, t:t + width].clone()
            with _Trace() as trace:
                model(input_ids=chunk, cache=first)
            earlier.append(trace.ops)
        parts, addresses = first.static_parts(), _cache_tensors(first)
        first.own_parts()  # the earlier call ends: its cache keeps copies, the parts stay with the recordings
        first.end_static()
        assert not set(_cache_tensors(first).values()) & set(addresses.values()) - {0}  # 0: empty tensors

        later = DeepseekV41Cache(model.config, dspark=True)
        model(input_ids=other[:, :later_prompt], cache=later)
        alone = copy.deepcopy(later)
        alone.make_static(capacity)
        unfit = copy.deepcopy(later)
        unfit.make_static(capacity + 1)
        assert not unfit.adopt_static_parts(parts)  # another capacity: another layout, nothing changed
        later.make_static(capacity)
        assert later.adopt_static_parts(parts) and _cache_tensors(later) == addresses
        step, verify = other[:, later_prompt:later_prompt + 1].clone(), other[:, later_prompt + 1:later_prompt + 7].clone()
        traces, got = [], []
        for chunk in (step, verify):
            with _Trace() as trace:
                got.append(model(input_ids=chunk, cache=later).logits)
            traces.append(trace.ops)
        want = [model(input_ids=chunk, cache=alone).logits for chunk in (step, verify)]
        next_ids = want[-1][:, -1].argmax(-1)
        drafts = dspark_draft(model, next_ids, later), dspark_draft(model, next_ids, alone)
    for a, b in zip(traces, earlier):
        diffs = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(a) == len(b) and not diffs, (len(a), len(b), diffs[:3])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(*drafts))


def test_greedy_verdict_keeps_the_drafts_the_backbone_agrees_with():
    draft_ids = torch.tensor([[7, 1, 2, 3], [7, 1, 9, 3], [7, 5, 2, 3]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]), 10).float()
    verdict = greedy_verdict(draft_ids, logits)
    assert verdict.accepted.tolist() == [3, 1, 0]
    assert verdict.next_ids.tolist() == [4, 2, 1]


def test_static_cache_refuses_what_it_cannot_replay():
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = DeepseekV41Cache(model.config)
    with pytest.raises(ValueError, match="prefilled cache"):
        cache.make_static(20)
    with torch.no_grad():
        model(input_ids=ids[:, :8], cache=cache)
        cache.make_static(10)
        with pytest.raises(ValueError, match="without an attention mask"):
            model(input_ids=ids[:, 8:10], attention_mask=torch.ones(1, 10, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=f"decode steps of 1 to {cache.crop_horizon + 1} tokens"):
            model(input_ids=torch.randint(3, 500, (1, cache.crop_horizon + 2)), cache=cache)
        with pytest.raises(ValueError, match="room for 2 more columns, not 3"):
            model(input_ids=ids[:, 8:11], cache=cache)
        model(input_ids=ids[:, 8:10], cache=cache)
        with pytest.raises(ValueError, match="room for 0 more columns"):
            model(input_ids=ids[:, 10:11], cache=cache)
        with pytest.raises(ValueError, match="crops only its own steps"):
            cache.crop(-3)
        cache.crop(-2)
        assert cache.columns == 8


def test_generate_with_cuda_graphs_needs_a_cuda_model():
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(8))
    cache = DeepseekV41Cache(model.config)
    with pytest.raises(ValueError, match="CUDA device"):
        model.generate(ids, max_new_tokens=4, do_sample=False, cuda_graphs=True, cache=cache)
    assert cache.generation_run is None  # nothing of the refused call is left, on the cache or the model
