"""expert_schedule (one Triton launch) against the torch schedule it replaces: expert_blocks' four tensors bit
for bit, padding blocks included, and the per-token stable argsort of the expert ids. Without a GPU the kernel
runs in Triton's interpreter, with one compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.triton.moe_schedule import expert_blocks, expert_schedule  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _routes(tokens: int, k: int, n_experts: int, seed: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random ids, half of them from three experts (ties within and across tokens), the rest spread over all."""
    gen = torch.Generator().manual_seed(seed)
    few = torch.randperm(n_experts, generator=gen)[:3]
    spread = torch.randint(0, n_experts, (tokens, k), generator=gen)
    tied = few[torch.randint(0, few.numel(), (tokens, k), generator=gen)]
    ids = torch.where(torch.rand(tokens, k, generator=gen) < 0.5, tied, spread)
    return ids.to(dtype=dtype, device=DEVICE)


def _check(experts: torch.Tensor, n_experts: int, block_rows: int) -> None:
    got = expert_schedule(experts, n_experts, block_rows)
    want = (*expert_blocks(experts, n_experts, block_rows), experts.argsort(dim=-1, stable=True).to(torch.int32))
    names = ("pair_of_row", "block_expert", "block_start", "block_end", "order")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.device == w.device and g.is_contiguous(), name
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("block_rows", [16, 64])
@pytest.mark.parametrize("n_experts", [5, 384])
@pytest.mark.parametrize("tokens", [1, 3, 32, 256])
def test_random_routes(tokens: int, n_experts: int, block_rows: int) -> None:
    _check(_routes(tokens, 6, n_experts, seed=tokens * 1000 + n_experts + block_rows), n_experts, block_rows)


@pytest.mark.parametrize("tokens", [3, 256])
def test_int32_ids(tokens: int) -> None:
    _check(_routes(tokens, 6, 384, seed=tokens, dtype=torch.int32), 384, 16)


@pytest.mark.parametrize("expert", [0, 383])
def test_one_expert_takes_all(expert: int) -> None:
    _check(torch.full((256, 6), expert, dtype=torch.int64, device=DEVICE), 384, 16)


@pytest.mark.parametrize("tokens", [1, 200])
def test_one_slot_per_token(tokens: int) -> None:
    _check(_routes(tokens, 1, 384, seed=tokens), 384, 16)


def test_odd_shapes() -> None:
    _check(_routes(40, 9, 3, seed=1), 3, 1)  # k past a power of two, one row per block
    _check(_routes(0, 6, 384, seed=2), 384, 16)  # no tokens: empty tensors, no launch


def test_moe_schedule_takes_torch_ops_past_the_one_launch_bound(monkeypatch) -> None:
    """Above ONE_LAUNCH_MAX_TOKENS the schedule comes from torch ops: the same five tensors."""
    from modeling_deepseek_v41.kernels.triton import moe_schedule as schedule
    experts = _routes(40, 6, 384, seed=3)
    launched = schedule.moe_schedule(experts, 384, 16)
    monkeypatch.setattr(schedule, "ONE_LAUNCH_MAX_TOKENS", 8)
    calls = []
    monkeypatch.setattr(schedule, "expert_schedule", lambda *args: calls.append(args))
    for got, want in zip(schedule.moe_schedule(experts, 384, 16), launched):
        assert torch.equal(got, want)
    assert not calls
