"""The decode linears' rows formulation (kernels/triton/linear_rows.py): in float64 (Triton's interpreter on the CPU)
it is the exact product of the stored weight; in the model's dtypes each row's sum is the same whatever the call's
row count up to ROWS_MAX_ROWS (what DSpark's verify against its one-token steps needs); ragged shapes, split K, pairs
and block-diagonal groups included."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from modeling_deepseek_v41.kernels import numerics  # noqa: E402
from modeling_deepseek_v41.kernels.triton.common import FMT_DENSE, FMT_FP8_TILE  # noqa: E402
from modeling_deepseek_v41.kernels.triton.linear_rows import ROWS_MAX_ROWS, row_block, rows_linear  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
EXACT = 1e-12  # float64: the same products, only the summation order differs
TILE = {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 1}  # small slices: several per split, a ragged last one


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _fp8(n, k, seed):
    w, s = numerics.quantize_fp8_weight(_randn(n, k, seed=seed, scale=0.02).cpu())
    return w.to(DEVICE), s.to(DEVICE), numerics.dequantize_fp8_weight(w, s).double().to(DEVICE)


@pytest.mark.skipif(CUDA, reason="float64 runs in the interpreter; compiled, the kernel takes the model's dtypes")
@pytest.mark.parametrize("m", [1, 3, ROWS_MAX_ROWS])
@pytest.mark.parametrize("split_target", [1, 512])  # one split; several (K chunks of 128 columns)
def test_rows_linear_in_float64_is_the_exact_product(m, split_target):
    n, k = 80, 352  # N past the last whole 32-row tile, K past the last whole slice
    w, s, exact = _fp8(n, k, seed=1)
    x = _randn(m, k, seed=2, dtype=torch.float64)
    out = rows_linear(x, w, s, FMT_FP8_TILE, n, k, torch.float64, tile=TILE, split_target=split_target)
    assert out.shape == (m, n) and _rel(out, x @ exact.t()) < EXACT
    dense = _randn(n, k, seed=3, dtype=torch.float64)
    assert _rel(rows_linear(x, dense, None, FMT_DENSE, n, k, torch.float64, tile=TILE,
                            split_target=split_target), x @ dense.t()) < EXACT


@pytest.mark.skipif(CUDA, reason="float64 runs in the interpreter")
def test_rows_linear_pairs_and_groups_in_float64():
    """Two weights on one input in one launch (each its own product), and a block-diagonal weight (wo_a)."""
    k = 256
    (w1, s1, e1), (w2, s2, e2) = _fp8(96, k, seed=4), _fp8(64, k, seed=5)
    x = _randn(5, k, seed=6, dtype=torch.float64)
    out1, out2 = rows_linear(x, w1, s1, FMT_FP8_TILE, 96, k, torch.float64, tile=TILE, split_target=512,
                             second=(w2, s2, 64))
    assert _rel(out1, x @ e1.t()) < EXACT and _rel(out2, x @ e2.t()) < EXACT
    groups, r = 3, 64
    wg, sg, eg = _fp8(groups * r, k, seed=7)
    xg = _randn(2, groups, k, seed=8, dtype=torch.float64)
    out = rows_linear(xg.reshape(2, -1), wg, sg, FMT_FP8_TILE, r, k, torch.float64, groups=groups, tile=TILE,
                      split_target=512)
    ref = torch.einsum("mgd,grd->mgr", xg, eg.view(groups, r, k))
    assert _rel(out.view(2, groups, r), ref) < EXACT


@pytest.mark.parametrize("split_target", [1, 512])
def test_a_rows_sum_does_not_depend_on_the_calls_rows(split_target):
    """bf16 activations exactly QDQ'd, FP8 and bf16 weights, random data: row i of a call of m rows equals row i
    of a call of ROWS_MAX_ROWS rows, bit for bit, for every m (1, 2, 4 and 8 row blocks)."""
    n, k = 96, 640
    w, s, _ = _fp8(n, k, seed=9)
    dense = _randn(n, k, seed=10, scale=0.05, dtype=torch.bfloat16)
    x = numerics.fp8_act_qdq(_randn(ROWS_MAX_ROWS, k, seed=11).cpu()).to(torch.bfloat16).to(DEVICE)
    for weight, scale, fmt in ((w, s, FMT_FP8_TILE), (dense, None, FMT_DENSE)):
        def call(rows):
            return rows_linear(rows, weight, scale, fmt, n, k, torch.float32, tile=TILE, split_target=split_target)

        full = call(x)
        for m in range(1, ROWS_MAX_ROWS):
            assert torch.equal(call(x[ROWS_MAX_ROWS - m:]), full[ROWS_MAX_ROWS - m:])
        ref = x.double() @ (numerics.dequantize_fp8_weight(w.cpu(), s.cpu()).double().to(DEVICE)
                            if scale is not None else dense.double()).t()
        assert _rel(full, ref) < 2e-6


@pytest.mark.parametrize("split_target", [1, 512])
def test_prefetching_the_next_tile_keeps_the_bits(split_target):
    """The next tile's loads issued ahead (a tuning option) leave each row's products and their order alone: the
    same bits as without, FP8 and dense weights, one row (QDQ'd inside) and six, ragged K, one split and several."""
    n, k = 80, 352
    w, s, _ = _fp8(n, k, seed=12)
    dense = _randn(n, k, seed=13, scale=0.05, dtype=torch.bfloat16)
    x = _randn(6, k, seed=14, dtype=torch.bfloat16)
    for weight, scale, fmt in ((w, s, FMT_FP8_TILE), (dense, None, FMT_DENSE)):
        for rows in (x[:1], x):
            plain, ahead = (rows_linear(rows, weight, scale, fmt, n, k, torch.float32, tile=dict(TILE, prefetch=p),
                                        split_target=split_target, quantize=fmt == FMT_FP8_TILE)
                            for p in (False, True))
            assert torch.equal(plain, ahead)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_as_they_are_are_quantized_once_with_the_same_bits_at_any_row_count(dtype):
    """quantize=True takes the activations as they are: one row is FP8-QDQ'd inside the kernel, more rows by a QDQ
    launch first. With the default tiles row i's result is the same bits at every row count, and those of the call
    on the exactly QDQ'd rows."""
    n, k = 96, 1280
    w, s, _ = _fp8(n, k, seed=14)
    x = _randn(ROWS_MAX_ROWS, k, seed=15, dtype=dtype)
    full = rows_linear(x, w, s, FMT_FP8_TILE, n, k, torch.float32, quantize=True)
    qdq = numerics.fp8_act_qdq(x.cpu().float()).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(full, rows_linear(qdq, w, s, FMT_FP8_TILE, n, k, torch.float32))
    for m in (1, 2, 6):
        assert torch.equal(rows_linear(x[:m], w, s, FMT_FP8_TILE, n, k, torch.float32, quantize=True), full[:m])


def test_a_wider_dense_weight_is_rounded_to_the_activations_dtype_in_registers():
    """The grouped wo_a with an fp32 weight and bf16 activations multiplies the weight rounded to bf16 (the
    reference's `weight.to(x.dtype)`), without a rounded copy: the bits of the call on the rounded copy."""
    from modeling_deepseek_v41.kernels.triton import grouped_linear

    groups, r, k = 2, 64, 256
    weight = _randn(groups * r, k, seed=12, scale=0.05)
    x = _randn(3, groups, k, seed=13, dtype=torch.bfloat16)
    out = grouped_linear(x, weight, None, groups)
    assert out.dtype == torch.bfloat16 and torch.equal(out, grouped_linear(x, weight.to(torch.bfloat16), None, groups))
    assert not torch.equal(weight.to(torch.bfloat16).float(), weight)  # the rounding is not a no-op here


def test_row_counts_past_the_formulation_are_refused():
    assert [row_block(m) for m in (1, 2, 3, 5, 8)] == [1, 2, 3, 5, 8]
    with pytest.raises(ValueError, match="1 to 8 rows"):
        row_block(ROWS_MAX_ROWS + 1)
