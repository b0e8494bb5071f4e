"""A pool's writes of a decode-sized step in one launch (`kernels/triton/pool_write.py`) leave the pool exactly as
the cache's torch path does: the completed rows' codes and scale bytes, the recent ring, the carry (copied in place
for a fixed pool, taken over otherwise). Without a GPU the kernel runs in the interpreter."""

from __future__ import annotations

import copy
import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.cache.pool import Pool  # noqa: E402
from modeling_deepseek_v41.kernels.numerics import fp4_quantize_rows  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
HEAD_DIM, INDEX_DIM = 64, 32


def _pool(ratio: int, fixed: bool, batch: int = 3) -> Pool:
    g = torch.Generator().manual_seed(ratio)
    pool = Pool(ratio, HEAD_DIM, INDEX_DIM, batch, horizon=6, device=torch.device(DEVICE),
                compute_dtype=torch.float32)
    pool.kv.resize(9)
    pool.keys.resize(9)
    for store in (pool.kv.codes, pool.kv.scales, pool.keys.codes, pool.keys.scales):
        store.copy_(torch.randint(0, 256, store.shape, generator=g, dtype=torch.uint8).to(DEVICE))
    if ratio > 1:
        pool.recent_kv.copy_(torch.randn(pool.recent_kv.shape, generator=g).to(DEVICE))
        pool.recent_score.copy_(torch.randn(pool.recent_score.shape, generator=g).to(DEVICE))
        pool.carry = tuple(torch.randn(batch, ratio, HEAD_DIM, generator=g).to(DEVICE) for _ in range(2))
    if fixed:
        pool.fix(16)
    return pool


def _step(ratio: int, batch: int = 3, seq: int = 2):
    g = torch.Generator().manual_seed(10 + ratio)
    groups = seq if ratio == 1 else (seq + ratio - 2) // ratio + 1
    rows = torch.tensor([[4, -1], [-1, -1], [0, 7]])[:, :groups]  # rows 0 and past the end, one batch row none
    latents = torch.randn(batch, groups, HEAD_DIM, generator=g) * torch.logspace(-8, 2, HEAD_DIM)  # e4m3 subnormal
    kv = fp4_quantize_rows(latents, 16, "e4m3")
    keys = fp4_quantize_rows(torch.randn(batch, groups, INDEX_DIM, generator=g), 32, "e8m0")
    positions = torch.tensor([[11, 12], [-1, 30], [5, -1]])[:, :seq]
    tokens = tuple(torch.randn(batch, seq, HEAD_DIM, generator=g) for _ in range(2)) if ratio > 1 else (None, None)
    carry = tuple(torch.randn(batch, ratio, HEAD_DIM, generator=g) for _ in range(2)) if ratio > 1 else None
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return (on(rows), tuple(map(on, kv)), tuple(map(on, keys)), None if carry is None else tuple(map(on, carry)),
            on(tokens[0]), on(tokens[1]), on(positions))


def _state(pool: Pool) -> list[torch.Tensor]:
    state = [pool.kv.codes, pool.kv.scales, pool.keys.codes, pool.keys.scales, pool.recent_kv, pool.recent_score]
    return [t.cpu() for t in state + list(pool.carry or ())]


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("fixed", [False, True])
def test_one_launch_pool_step_leaves_the_pool_the_torch_path_leaves(ratio, fixed, monkeypatch):
    import modeling_deepseek_v41.cache.pool as pool_module

    step = _step(ratio)
    torch_pool = _pool(ratio, fixed)
    kernel_pool = copy.deepcopy(torch_pool)
    held = kernel_pool.carry
    calls = []
    with torch.no_grad():
        monkeypatch.setattr(pool_module, "kernel_path", lambda x: False)
        torch_pool._write_without_reads(*step)
        monkeypatch.setattr(pool_module, "kernel_path", lambda x: x.numel() > 0)
        real = pool_module.triton_kernels

        def counted():
            calls.append(1)
            return real()
        monkeypatch.setattr(pool_module, "triton_kernels", counted)
        kernel_pool._write_without_reads(*step)
    assert calls, "the one-launch path was not taken"
    for got, want in zip(_state(kernel_pool), _state(torch_pool), strict=True):
        assert torch.equal(got, want)
    if ratio > 1 and fixed:  # in place: a replayed graph reads the carry where it wrote it
        assert all(a is b for a, b in zip(kernel_pool.carry, held))
