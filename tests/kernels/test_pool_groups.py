"""The compressor's pooling of a decode-sized chunk in one launch against the op's exact path (fixed shapes):
the same groups, pool rows and carry; the latents equal to 1e-10 in float64 (the interpreter), and within fp32
rounding of the softmax in the model's dtypes."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.compress import pool_groups  # noqa: E402
from modeling_deepseek_v41.kernels.triton import pool_groups as fused_pool_groups  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _case(acc, ratio, seq, carried, seed=0):
    """Rows starting at several offsets within a group, one left-padded, one with no token (all padding)."""
    g = torch.Generator().manual_seed(seed)
    batch, hd = 5, 64
    starts = torch.tensor([10, 7, 12, 3, 0])[:batch]
    positions = starts.unsqueeze(1) + torch.arange(seq)
    positions[1, : seq // 2] = -1  # left padding
    positions[4] = -1  # nothing in this row
    kv = torch.randn(batch, seq, hd, generator=g, dtype=acc)
    score = torch.randn(batch, seq, hd, generator=g, dtype=acc) * 3
    carry = None
    if carried:  # the open group's earlier tokens: slot p % r filled up to the row's first position
        carry_kv = torch.randn(batch, ratio, hd, generator=g, dtype=acc)
        carry_score = torch.randn(batch, ratio, hd, generator=g, dtype=acc)
        first = torch.where(positions >= 0, positions, 10**6).amin(dim=1).clamp_max(starts.max())
        empty = torch.arange(ratio).unsqueeze(0) >= (first % ratio).unsqueeze(1)
        carry_kv = torch.where(empty.unsqueeze(-1), 0.0, carry_kv)
        carry_score = torch.where(empty.unsqueeze(-1), -torch.inf, carry_score)
        carry = (carry_kv, carry_score)
    return kv, score, positions, carry


@pytest.mark.parametrize("dtype", [torch.bfloat16] + ([] if CUDA else [torch.float64]))
@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("seq", [1, 2, 6])
@pytest.mark.parametrize("carried", [False, True])
def test_fused_pooling_equals_the_exact_pooling(dtype, ratio, seq, carried):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kv, score, positions, carry = _case(acc, ratio, seq, carried)
    latents, rows, (new_kv, new_score) = pool_groups(kv, score, positions, carry, ratio, True, dtype)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got, got_rows, (got_kv, got_score) = fused_pool_groups(dev(kv), dev(score), dev(positions),
                                                           None if carry is None else tuple(map(dev, carry)),
                                                           ratio, dtype)
    assert torch.equal(got_rows.cpu(), rows) and ((rows >= 0).any() or seq < ratio)  # some group completes
    assert torch.equal(got_kv.cpu(), new_kv) and torch.equal(got_score.cpu(), new_score)
    got = got.cpu()
    assert got.dtype == dtype and torch.equal(got == 0, latents == 0)
    if (latents != 0).any():
        rel = ((got.double() - latents.double()).norm() / latents.double().norm()).item()
        if dtype == torch.float64:
            assert rel <= 1e-10
        else:
            assert rel <= 2.0**-8 and (got == latents).double().mean() >= 0.95
