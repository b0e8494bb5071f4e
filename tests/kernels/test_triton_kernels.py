"""The Triton kernels against the fp32 emulation (kernels.numerics, kernels.linear, layers.linear, layers.moe).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are defined) on
small shapes; the interpreter runs every kernel here, FP8 dots included. With a GPU the same checks run compiled,
plus the released shapes. Bounds are the measured errors with margin; the emulation is the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels import numerics  # noqa: E402
from modeling_deepseek_v41.kernels.expert_ops import gathered_swiglu  # noqa: E402
from modeling_deepseek_v41.kernels.triton import (  # noqa: E402
    dense_linear, fp4_linear, fp4_to_fp8_weight, fp8_act_qdq, fp8_act_quant, fp8_linear, fp8_row_linear,
    grouped_linear, grouped_moe,
)
from modeling_deepseek_v41.kernels.triton.common import cast, e2m1_value, round_e4m3  # noqa: E402
from modeling_deepseek_v41.kernels.triton.linear import (  # noqa: E402
    DECODE_MAX_ROWS, DECODE_TILE, SPLIT_TARGET_PROGRAMS, split_count,
)
from modeling_deepseek_v41.kernels.triton.linear_rows import ROWS_MAX_ROWS  # noqa: E402
from modeling_deepseek_v41.kernels.triton.moe import MOE_DECODE_TILE, MOE_ROWS_MAX_TOKENS  # noqa: E402
from modeling_deepseek_v41.kernels.triton.moe_rows import ROWS_TILE as MOE_ROWS_TILE, rows_moe  # noqa: E402
from modeling_deepseek_v41.kernels.triton.moe_schedule import expert_blocks  # noqa: E402
from modeling_deepseek_v41.layers.linear import DeepseekV41Linear  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
BF16_ULP = 2.0**-7  # one bf16 ulp, relative, at worst


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm()).item()


def _emulated_linear(x, weight, scale, storage):
    layer = DeepseekV41Linear(x.shape[-1], weight.shape[0], storage=storage).to(x.device)
    layer.weight.data, layer.scale.data = weight, scale
    with torch.enable_grad():  # a CUDA call without gradients would take the kernels themselves
        return layer(x)


FP32_BOUND = 2e-6  # normwise, exact products with fp32 accumulation (only the summation order differs)
FP8_DOT_BOUND = 1e-4 if CUDA else 2e-6  # Hopper's FP8 dots sum with less than fp32 precision: 4.6e-5 measured


def _assert_close_to_emulation(out, ref, dtype, bound=FP32_BOUND):
    """fp32 outputs: normwise at `bound`; bf16 outputs: each element within one bf16 rounding of the reference,
    plus `bound` of the output's rms for results that cancel to near zero."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        assert _rel(out, ref) < bound
    else:
        ref64 = ref.double()
        diff = (out.double() - ref64).abs()
        assert (diff <= BF16_ULP * ref64.abs() + bound * ref64.pow(2).mean().sqrt()).all()


# --- activation quantization -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_qdq_is_bit_exact(dtype):
    x = _randn(7, 256, seed=0, dtype=torch.float32)
    x = x * torch.logspace(-12, 6, 8, base=2).repeat_interleave(32).to(DEVICE)  # groups of very different scale
    x[0, :32] = 0.0  # amax below 1e-4: the clamp decides the scale
    x[1, :32] = torch.arange(32, device=DEVICE) * 2.0**-5  # ties of the e4m3 grid
    x = x.to(dtype)
    assert torch.equal(fp8_act_qdq(x), numerics.fp8_act_qdq(x))
    q, s = fp8_act_quant(x)
    assert torch.equal((q.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2).to(dtype),
                       numerics.fp8_act_qdq(x))


@triton.jit
def _bf16_cast_kernel(x_ptr, out_ptr, n, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, cast(tl.load(x_ptr + offsets, mask=offsets < n), tl.bfloat16), mask=offsets < n)


def test_bf16_cast_rounds_to_nearest_even():
    """The kernels' fp32 -> bf16 rounding (compiled: the conversion instruction; interpreted: integer arithmetic) is
    torch's: ties to even, carries into the exponent, subnormals, overflow to infinity, NaN kept."""
    special = [0x3F808000, 0x3F818000, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x00018000, 0x00007FFF,
               0x7F800000, 0x7FC00000, 0x00000000, 0x3F800001]
    bits = torch.cat([torch.tensor(special, dtype=torch.int64), torch.randint(0, 1 << 32, (4096 - len(special),),
                                                                               generator=_gen(8))])
    bits = torch.cat([bits, bits | (1 << 31)]).to(torch.int64)
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    if not CUDA:  # the interpreter's own fp32 -> bf16 conversion flushes subnormal results to zero
        x = x[(x.abs() >= torch.finfo(torch.float32).tiny) | (x == 0) | x.isnan()]
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _bf16_cast_kernel[(1,)](x.to(DEVICE), out, x.numel(), N=8192)
    expected = x.to(torch.bfloat16)
    assert torch.equal(out.cpu().isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out.cpu()[finite].view(torch.int16), expected[finite].view(torch.int16))


@triton.jit
def _e4m3_round_kernel(x_ptr, out_ptr, n, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, round_e4m3(tl.load(x_ptr + offsets, mask=offsets < n)), mask=offsets < n)


def test_e4m3_rounding_is_torchs():
    """The kernels' e4m3 rounding of values within [-448, 448] (compiled: the conversion instruction; interpreted:
    integer arithmetic) is torch's: ties to even on the normal and the subnormal grid."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    uniform = torch.rand(4096, generator=_gen(9)) * 448.0
    tiny = torch.rand(1024, generator=_gen(10)) * 2.0**-6
    x = torch.cat([grid, ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(448.0)), uniform, tiny])
    x = torch.cat([x, -x])
    out = torch.empty_like(x, device=DEVICE)
    _e4m3_round_kernel[(1,)](x.to(DEVICE), out, x.numel(), N=triton.next_power_of_2(x.numel()))
    assert torch.equal(out.cpu(), x.to(torch.float8_e4m3fn).float())


@triton.jit
def _e2m1_kernel(out_ptr):
    codes = tl.arange(0, 16)
    tl.store(out_ptr + codes, e2m1_value(codes))


def test_e2m1_values_are_the_codes():
    """The kernels' e2m1 decoding (bits placed in an fp16) gives every code's value, signed zero included."""
    out = torch.empty(16, device=DEVICE)
    _e2m1_kernel[(1,)](out)
    expected = numerics.e2m1_values(torch.arange(16))
    assert torch.equal(out.cpu(), expected) and torch.equal(out.cpu().signbit(), expected.signbit())


def test_fp4_to_fp8_reencode_is_exact():
    packed, scale = numerics.quantize_fp4_weight(_randn(64, 128, seed=1).cpu())
    fp8 = fp4_to_fp8_weight(packed.to(DEVICE))
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (64, 128)
    assert torch.equal(fp8.float().cpu(), numerics.e2m1_values(numerics.unpack_nibbles(packed)))


# --- linears -------------------------------------------------------------------------------------------------

def _fp8_weight(n, k, seed):
    w, s = numerics.quantize_fp8_weight(_randn(n, k, seed=seed, scale=0.02).cpu())
    return w.to(DEVICE), s.to(DEVICE)


def _fp4_weight(n, k, seed):
    w, s = numerics.quantize_fp4_weight(_randn(n, k, seed=seed, scale=0.02).cpu())
    return w.to(DEVICE), s.to(DEVICE)


SMALL = [(3, 96, 160), (17, 64, 512)]  # the second takes the split-K path (4 splits of 128 columns)


@pytest.mark.parametrize("m,n,k", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dot", [False, True])
def test_fp8_linear_matches_emulation(m, n, k, dtype, fp8_dot):
    w, s = _fp8_weight(n, k, seed=2)
    x = _randn(m, k, seed=3, dtype=dtype)
    out = fp8_linear(x, w, s, fp8_dot=fp8_dot)
    _assert_close_to_emulation(out, _emulated_linear(x, w, s, "fp8"), dtype, FP8_DOT_BOUND if fp8_dot else FP32_BOUND)


@pytest.mark.parametrize("m,n,k", SMALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dot", [False, True])
def test_fp4_linear_and_its_fp8_reencode_match_emulation(m, n, k, dtype, fp8_dot):
    w, s = _fp4_weight(n, k, seed=4)
    x = _randn(m, k, seed=5, dtype=dtype)
    ref = _emulated_linear(x, w, s, "fp4")
    bound = FP8_DOT_BOUND if fp8_dot else FP32_BOUND
    _assert_close_to_emulation(fp4_linear(x, w, s, fp8_dot=fp8_dot), ref, dtype, bound)
    _assert_close_to_emulation(fp8_row_linear(x, fp4_to_fp8_weight(w), s, fp8_dot=fp8_dot), ref, dtype, bound)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_matches_f_linear(dtype):
    for m, n, k in SMALL:
        w = _randn(n, k, seed=6, scale=0.05, dtype=dtype)
        x = _randn(2, m, k, seed=7, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.to(dtype).float(), w.float()).to(dtype)
        _assert_close_to_emulation(dense_linear(x, w), ref, dtype)


def test_prefill_sized_call_matches_emulation():
    m, n, k = DECODE_MAX_ROWS + 9, 96, 128
    w, s = _fp8_weight(n, k, seed=8)
    x = _randn(m, k, seed=9, dtype=torch.float32)
    ref = _emulated_linear(x, w, s, "fp8")
    assert _rel(fp8_linear(x, w, s), ref) < FP32_BOUND  # dequantized bf16 scratch weight through F.linear
    assert _rel(fp8_linear(x, w, s, fp8_dot=True), ref) < FP8_DOT_BOUND  # Triton, FP8 dots, prefill tiles
    assert _rel(fp8_linear(x, w, s, fp8_dot=False), ref) < FP32_BOUND


def _nan_padded_scales(scale, pad=3):
    """The same scales as a view into a buffer whose bytes past each row are 0xFF (E8M0 NaN): a kernel that reads
    a scale past K (a masked K slice) turns its zero products into NaN."""
    full = torch.full((*scale.shape[:-1], scale.shape[-1] + pad), 255, dtype=torch.uint8, device=scale.device)
    full[..., :scale.shape[-1]] = scale.view(torch.uint8)
    return full.view(torch.float8_e8m0fnu)[..., :scale.shape[-1]]


@pytest.mark.parametrize("fp8_dot", [False, True])
def test_k_slices_past_the_end_read_no_scale(fp8_dot):
    """K = 160 leaves three of the last block's four 32-wide slices past the end (and K = 64 two of one)."""
    x = _randn(3, 160, seed=15, dtype=torch.float32)
    w8, s8 = _fp8_weight(64, 160, seed=16)
    w4, s4 = _fp4_weight(64, 160, seed=17)
    bound = FP8_DOT_BOUND if fp8_dot else FP32_BOUND
    assert _rel(fp8_linear(x, w8, _nan_padded_scales(s8), fp8_dot=fp8_dot), _emulated_linear(x, w8, s8, "fp8")) < bound
    assert _rel(fp4_linear(x, w4, _nan_padded_scales(s4), fp8_dot=fp8_dot), _emulated_linear(x, w4, s4, "fp4")) < bound
    w1, s1, w3, s3, w2, s2 = _experts(4, 64, 64, True, seed=18)
    tokens = _randn(5, 64, seed=19, dtype=torch.float32)
    experts, weights = _routing(5, 4, 2, seed=20)
    padded = (w1, _nan_padded_scales(s1), w3, _nan_padded_scales(s3), w2, _nan_padded_scales(s2))
    out = grouped_moe(tokens, experts, weights, *padded, limit=0.5, fp8_dot=fp8_dot)
    assert _rel(out, _emulated_moe(tokens, experts, weights, (w1, s1, w3, s3, w2, s2), limit=0.5)) < 2e-3


def test_split_count_depends_on_the_weight_only():
    bk, bn = DECODE_TILE["BK"], DECODE_TILE["BN"]
    splits, chunk = split_count(64, 4096)
    assert chunk % bk == 0 and (splits - 1) * chunk < 4096 <= splits * chunk  # whole K blocks, none empty
    assert split_count(5120, 8192)[0] * (5120 // bn) >= SPLIT_TARGET_PROGRAMS  # fills the GPU at one row
    assert split_count(32768, 1280)[0] == 1  # enough column blocks unsplit


def _check_batch_invariance(fn, x):
    """Within each formulation's row range (linear_rows up to ROWS_MAX_ROWS, the tiles above), row i of a call
    equals row i computed alone or within any smaller call of that range, bit for bit."""
    few = x[:ROWS_MAX_ROWS]
    full = fn(few)
    for i in (0, few.shape[0] - 1) if not CUDA else range(few.shape[0]):
        assert torch.equal(fn(few[i:i + 1]), full[i:i + 1])
    assert torch.equal(fn(few[:3]), full[:3])
    if x.shape[0] > ROWS_MAX_ROWS + 1:
        full, part = fn(x), max(ROWS_MAX_ROWS + 1, x.shape[0] // 3)
        assert torch.equal(fn(x[:part]), full[:part])
        assert torch.equal(fn(x[-ROWS_MAX_ROWS - 1:]), full[-ROWS_MAX_ROWS - 1:])


def test_linears_are_batch_invariant(monkeypatch):
    """A row's output does not depend on the other rows of the call, bit for bit. On a GPU on random data: the
    tiles and the split-K follow from the weight only. In the CPU interpreter a tile's fp32 dot is the host BLAS's,
    which may round a row differently by its place in the tile (AMD EPYC: -1.6375 alone, -1.6374 in a batch), so
    there the data are dyadic with every partial sum exact in fp32: any summation order gives the same bits, and the
    check covers the kernels' own row handling. An emulated BLAS that sums every other row (and column) in reverse
    order shows it (it does change the rounding of random data)."""
    n, k = 64, 512
    if CUDA:
        w8, s8 = _fp8_weight(n, k, seed=10)
        w4, s4 = _fp4_weight(n, k, seed=11)
        wd = _randn(n, k, seed=12, scale=0.05, dtype=torch.bfloat16)
        x = _randn(DECODE_MAX_ROWS, k, seed=13, dtype=torch.bfloat16)
    else:  # values in {0, +-1/4, +-1/2, +-1}, each group's amax 1: exact codes, power-of-two scales, exact sums
        def dyadic(rows, seed):
            levels = torch.tensor([-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0])
            values = levels[torch.randint(0, len(levels), (rows, k), generator=_gen(seed))]
            values[:, ::32] = 1.0
            return values

        w8, s8 = numerics.quantize_fp8_weight(dyadic(n, 10))
        w4, s4 = numerics.quantize_fp4_weight(dyadic(n, 11))
        assert torch.equal(numerics.dequantize_fp8_weight(w8, s8), dyadic(n, 10))
        assert torch.equal(numerics.dequantize_fp4_weight(w4, s4), dyadic(n, 11))
        wd, x = dyadic(n, 12).to(torch.bfloat16), dyadic(18, 13).to(torch.bfloat16)

    def check_all():
        _check_batch_invariance(lambda t: fp8_linear(t, w8, s8), x)
        _check_batch_invariance(lambda t: fp4_linear(t, w4, s4), x)
        _check_batch_invariance(lambda t: dense_linear(t, wd), x)
        _check_batch_invariance(lambda t: dense_linear(t, wd.float()), x.float())

    check_all()
    if CUDA:
        return
    import numpy as np

    host_matmul = np.matmul

    def place_dependent_matmul(a, b, **kwargs):  # odd rows of a and odd columns of b summed in reverse order
        out = host_matmul(a, b, **kwargs)
        if a.ndim == 2 and b.ndim == 2:
            out[:, 1::2] = host_matmul(a[:, ::-1], b[::-1, 1::2], **kwargs)
            out[1::2] = host_matmul(a[1::2, ::-1], b[::-1], **kwargs)
        return out

    monkeypatch.setattr(np, "matmul", place_dependent_matmul)
    check_all()
    # the emulated BLAS does change a dot's rounding of random data (a dense fp32 grouped projection: fp32 linears
    # multiply without a dot)
    noisy_w, noisy_x = _randn(n, k, seed=12, scale=0.05), _randn(ROWS_MAX_ROWS + 2, 1, k, seed=13)
    later = grouped_linear(noisy_x[1:], noisy_w, None, 1)[0]  # both calls in the tiles' range, row 1 moved to 0
    assert not torch.equal(grouped_linear(noisy_x, noisy_w, None, 1)[1], later)


@pytest.mark.parametrize("m", [3, DECODE_MAX_ROWS + 5])
def test_a_pair_of_linears_on_one_input_is_each_linear(m):
    """linear_pair (the query/KV down-projections, the shared expert's gate and up): one QDQ and one launch give
    each FP8 linear's emulated result (K split from both weights' rows), batch invariant, and dense bf16 pairs the
    dense linear's; prefill sizes fall back to two calls."""
    from modeling_deepseek_v41.kernels.triton import linear_pair

    (w1, s1), (w2, s2) = _fp8_weight(96, 320, seed=50), _fp8_weight(64, 320, seed=51)
    x = _randn(m, 320, seed=52)
    out1, out2 = linear_pair(x, (w1, s1), (w2, s2))
    _assert_close_to_emulation(out1, _emulated_linear(x, w1, s1, "fp8"), x.dtype)
    _assert_close_to_emulation(out2, _emulated_linear(x, w2, s2, "fp8"), x.dtype)
    d1, d2 = _randn(96, 320, seed=53, scale=0.05, dtype=torch.bfloat16), _randn(64, 320, seed=54, scale=0.05,
                                                                               dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    dense1, dense2 = linear_pair(xb, (d1, None), (d2, None))
    _assert_close_to_emulation(dense1, (xb.double() @ d1.double().t()).to(torch.bfloat16), torch.bfloat16)
    _assert_close_to_emulation(dense2, (xb.double() @ d2.double().t()).to(torch.bfloat16), torch.bfloat16)
    if m <= DECODE_MAX_ROWS:
        _check_batch_invariance(lambda t: torch.cat(linear_pair(t, (w1, s1), (w2, s2)), dim=-1), x)
    with pytest.raises(ValueError, match="two FP8 weights"):
        linear_pair(x, (w1, s1), (d2, None))


def test_fp32_weights_multiply_exactly_in_a_fixed_order():
    """The fp32-weight decode linear (the head) computes x @ w^T with true fp32 products: in float64 it equals the
    exact product to 1e-12; in fp32 a row's result is the same alone and in any batch, on random data, bit for bit
    (the kernel's own summation order, no dot); ragged N and K and split K included."""
    from modeling_deepseek_v41.kernels.triton.fp32_rows import fp32_rows_linear

    w, x = _randn(150, 520, seed=40, scale=0.05), _randn(9, 520, seed=41)
    exact = x.double() @ w.double().t()
    assert _rel(fp32_rows_linear(x.double(), w.double(), split_target=64), exact) < 1e-12
    assert _rel(fp32_rows_linear(x, w, split_target=64), exact) < FP32_BOUND
    _check_batch_invariance(lambda t: fp32_rows_linear(t, w, split_target=64), x)
    _check_batch_invariance(lambda t: dense_linear(t, w), x)
    gate, rows = _randn(32, 2048, seed=42, scale=0.05), _randn(6, 2048, seed=43)  # one tile: K split MAX_SPLITS ways
    assert _rel(fp32_rows_linear(rows.double(), gate.double()), rows.double() @ gate.double().t()) < 1e-12
    _check_batch_invariance(lambda t: fp32_rows_linear(t, gate), rows)


def test_the_routers_fp32_linear_needs_no_fp32_copies():
    """fp32_linear (the router's logits) takes bf16 rows and a bf16 weight as they are and gives the bits of the
    fp32 kernel on their fp32 copies."""
    from modeling_deepseek_v41.kernels.triton import fp32_linear

    wb, xb = _randn(40, 320, seed=42, scale=0.05, dtype=torch.bfloat16), _randn(3, 320, seed=43, dtype=torch.bfloat16)
    out = fp32_linear(xb, wb)
    assert out.dtype == torch.float32 and torch.equal(out, dense_linear(xb.float(), wb.float()))


@pytest.mark.parametrize("m", [3, DECODE_MAX_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_linear_matches_the_einsum_on_the_exact_weight(m, dtype):
    """The attention's wo_a: each group through its rows of the FP8 weight, dequantized exactly, no activation QDQ
    (decode rows: the Triton kernel; prefill rows: one exact copy and the einsum); and dense weights."""
    groups, r, d = 3, 32, 160
    w, s = _fp8_weight(groups * r, d, seed=30)
    x = _randn(m, groups, d, seed=31, dtype=dtype)
    exact = numerics.dequantize_fp8_weight(w, s, dtype).view(groups, r, d)
    ref = torch.einsum("mgd,grd->mgr", x.double(), exact.double()).to(dtype)
    _assert_close_to_emulation(grouped_linear(x, w, s, groups), ref, dtype)
    wd = _randn(groups * r, d, seed=32, scale=0.05, dtype=dtype)
    ref = torch.einsum("mgd,grd->mgr", x.double(), wd.view(groups, r, d).double()).to(dtype)
    _assert_close_to_emulation(grouped_linear(x, wd, None, groups), ref, dtype)
    if m <= DECODE_MAX_ROWS:
        _check_batch_invariance(lambda t: grouped_linear(t, w, s, groups), x)


def test_bad_inputs_raise():
    w, s = _fp8_weight(32, 64, seed=14)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(_randn(2, 32, seed=0), w, s)
    with pytest.raises(ValueError, match="divisible by 32"):
        fp8_act_qdq(_randn(2, 40, seed=0))
    with pytest.raises(TypeError, match="weight"):
        dense_linear(_randn(2, 64, seed=0), w)


# --- grouped MoE ---------------------------------------------------------------------------------------------

def _experts(n_experts, d, inter, quantized, seed):
    def make(n, k, s):
        dense = _randn(n_experts, n, k, seed=s, scale=0.05).cpu()
        if not quantized:
            return dense.to(torch.bfloat16).to(DEVICE), None
        packed = [numerics.quantize_fp4_weight(e) for e in dense]
        return (torch.stack([p for p, _ in packed]).to(DEVICE), torch.stack([q for _, q in packed]).to(DEVICE))
    w1, s1 = make(inter, d, seed)
    w3, s3 = make(inter, d, seed + 1)
    w2, s2 = make(d, inter, seed + 2)
    return w1, s1, w3, s3, w2, s2


def _routing(t, n_experts, top_k, seed):
    scores = torch.rand(t, n_experts, generator=_gen(seed))
    experts = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(t, top_k, generator=_gen(seed + 1)) * 1.5
    return experts.to(DEVICE), weights.to(DEVICE)


def _emulated_moe(tokens, experts, weights, stacks, limit, chunk=8):
    """DeepseekV41MoE.forward's routed part: gathered_swiglu in ascending expert order, summed in fp32 (in chunks
    of tokens: it gathers one fp32 copy of the expert weights per (token, expert) pair)."""
    order = experts.argsort(dim=-1, stable=True)
    sorted_experts, sorted_weights = experts.gather(1, order), weights.gather(1, order)
    contributions = torch.cat([
        gathered_swiglu(tokens[i:i + chunk], sorted_experts[i:i + chunk], sorted_weights[i:i + chunk], limit,
                        *stacks)
        for i in range(0, tokens.shape[0], chunk)])
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    for slot in range(experts.shape[1]):
        out = out + contributions[:, slot]
    return out


@pytest.mark.parametrize("quantized,fp8_dot,f16_slices", [(True, False, None), (True, False, True),
                                                         (True, False, False), (True, True, None),
                                                         (False, False, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_moe_matches_emulation(quantized, fp8_dot, f16_slices, dtype):
    """Quantized experts at 9 tokens (past the rows formulation) take by default the bf16 tiles with each FP4 value
    times its scale (fp4_dot), f16_slices True the fp16 tensor-core slices, False the default: all the emulation's
    numbers up to fp32 summation order."""
    n_experts, d, inter, top_k, t = 6, 64, 64, 3, 9
    stacks = _experts(n_experts, d, inter, quantized, seed=20)
    tokens = _randn(t, d, seed=23, dtype=dtype)
    experts, weights = _routing(t, n_experts, top_k, seed=24)
    experts[0] = torch.tensor([5, 1, 3])  # unsorted ids within a token
    ref = _emulated_moe(tokens, experts, weights, stacks, limit=0.5)
    out = grouped_moe(tokens, experts, weights, *stacks, limit=0.5, fp8_dot=fp8_dot, f16_slices=f16_slices)
    assert out.dtype == torch.float32 and out.shape == (t, d)
    # bf16 activations: a last-bit difference in gate/up/h can move h's FP8 QDQ by one e4m3 step
    assert _rel(out, ref) < (1e-6 if dtype == torch.float32 and not quantized else 2e-3)
    if quantized and not fp8_dot and f16_slices is None and dtype == torch.bfloat16:
        w1, s1, w3, s3, w2, s2 = stacks
        reencoded = (fp4_to_fp8_weight(w1), s1, fp4_to_fp8_weight(w3), s3, fp4_to_fp8_weight(w2), s2)
        out8 = grouped_moe(tokens, experts, weights, *reencoded, limit=0.5, fp8_experts=True)
        assert _rel(out8, ref) < 2e-3


def test_fp4_tiles_stay_exact_for_scales_past_two():
    """The FP4 tiles fold each E8M0 scale into bf16 values through powers of two that bf16 must hold: weight rows
    whose scale bytes run from about 105 to 145 (past 128, where 2^(S-1) leaves bf16's range) give the
    emulation's numbers as the ordinary ones do."""
    n_experts, d, inter, top_k, t = 4, 64, 96, 2, 9
    stacks = list(_experts(n_experts, d, inter, True, seed=70))
    for i, (n, k) in ((0, (inter, d)), (4, (d, inter))):  # w1 and w2: a power of two per output row
        dense = _randn(n_experts, n, k, seed=71 + i, scale=0.05).cpu() * 2.0 ** (torch.arange(n) % 41 - 20)[:, None]
        packed = [numerics.quantize_fp4_weight(e) for e in dense]
        stacks[i] = torch.stack([w for w, _ in packed]).to(DEVICE)
        stacks[i + 1] = torch.stack([q for _, q in packed]).to(DEVICE)
    bytes_ = stacks[1].view(torch.uint8)
    assert bytes_.max() > 128 and bytes_.min() < 110
    tokens = _randn(t, d, seed=73, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=74)
    out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0)  # 9 tokens: the tiles
    assert _rel(out, _emulated_moe(tokens, experts, weights, stacks, limit=10.0)) < 2e-3


@pytest.mark.parametrize("per_group", [2, 6])
def test_grouped_moe_through_the_grouped_gemm_matches_emulation(monkeypatch, per_group):
    """A prefill's packed FP4 experts on a Hopper: bf16 copies of the experts and torch's grouped GEMM (forced
    here; the CPU runs torch's own grouped GEMM), in groups of experts (or all in one, which reads nothing back),
    one of them without rows: the emulation's numbers up to fp32 summation order, the shared expert added in the
    last launch."""
    from modeling_deepseek_v41.kernels.triton import moe_grouped_gemm

    n_experts, d, inter, top_k, t = 6, 64, 96, 3, 11
    monkeypatch.setattr(moe_grouped_gemm, "GROUP_BYTES", per_group * 3 * inter * d * 2)
    if per_group == n_experts:  # nothing is read back to the host
        def no_host_read(self):
            raise AssertionError("read back to the host")
        monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    stacks = _experts(n_experts, d, inter, True, seed=30)
    tokens = _randn(t, d, seed=33, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts - 1, top_k, seed=34)
    experts = torch.where(experts >= 4, experts + 1, experts)  # expert 4 gets no row
    shared = _randn(t, d, seed=35, dtype=torch.bfloat16)
    out = grouped_moe(tokens, experts, weights, *stacks, limit=0.5, grouped_gemm=True)
    assert out.dtype == torch.float32 and out.shape == (t, d)
    assert _rel(out, _emulated_moe(tokens, experts, weights, stacks, limit=0.5)) < 2e-3
    with_shared = grouped_moe(tokens, experts, weights, *stacks, limit=0.5, grouped_gemm=True, shared=shared)
    assert torch.equal(with_shared, (out + shared.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="grouped_gemm takes packed FP4 experts and bf16 tokens"):
        grouped_moe(tokens.float(), experts, weights, *stacks, limit=0.5, grouped_gemm=True)
    w1, s1 = stacks[:2]
    assert torch.equal(moe_grouped_gemm.fp4_to_bf16(w1, s1).cpu(),
                       numerics.dequantize_fp4_weight(w1.cpu(), s1.cpu()).to(torch.bfloat16))


@pytest.mark.parametrize("quantized,rows", [(True, None), (True, False), (False, None)])
def test_grouped_moe_split_k_sums_in_one_launch(quantized, rows):
    """K split across programs (the decode regime's split, forced small here): the last program of each tile adds
    the partials in split order, so the result matches the emulation and is the same on every call (the rows
    formulation, quantized by default, and the tensor-core tiles)."""
    n_experts, d, inter, top_k, t = 4, 192, 128, 2, 3
    stacks = _experts(n_experts, d, inter, quantized, seed=40)
    tokens = _randn(t, d, seed=43, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=44)
    tile, split = dict(MOE_DECODE_TILE, BK=64), dict(up=64, down=64)  # 3 and 2 splits
    out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, tile=tile, k_chunks=split, rows=rows)
    assert torch.equal(out, grouped_moe(tokens, experts, weights, *stacks, limit=10.0, tile=tile, k_chunks=split,
                                        rows=rows))
    assert _rel(out, _emulated_moe(tokens, experts, weights, stacks, limit=10.0)) < 2e-3


@pytest.mark.parametrize("t", [1, 8])
def test_rows_moe_prefetch_keeps_the_bits(t):
    """The rows formulation with each next slice's loads issued ahead (a tuning option) sums the same products in
    the same order as without: the same bits, over split K (3 and 2 splits of 64 columns), one row and pairs."""
    n_experts, d, inter, top_k = 4, 192, 128, 2
    stacks = _experts(n_experts, d, inter, True, seed=40)
    tokens = _randn(t, d, seed=43, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=44)
    split = dict(up=64, down=64)
    plain = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, tile=dict(MOE_ROWS_TILE, BK=64),
                        k_chunks=split, rows=True)
    ahead = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, tile=dict(MOE_ROWS_TILE, BK=64, prefetch=True),
                        k_chunks=split, rows=True)
    assert torch.equal(plain, ahead)
    assert _rel(ahead, _emulated_moe(tokens, experts, weights, stacks, limit=10.0)) < 2e-3


@pytest.mark.parametrize("t", [MOE_ROWS_MAX_TOKENS, 19])
def test_grouped_moe_is_batch_invariant(t):
    """Within each formulation's token range (the rows up to MOE_ROWS_MAX_TOKENS, the tiles above) a token's sum
    does not depend on the other tokens of the call (with 8 tokens the rows formulation takes its rows two at a
    time, a token alone one at a time)."""
    from modeling_deepseek_v41.kernels.triton.moe_rows import PAIR_ROWS, rows_per_expert

    n_experts, d, inter, top_k = 6, 64, 64, 3
    assert rows_per_expert(1, top_k, n_experts) < PAIR_ROWS <= rows_per_expert(MOE_ROWS_MAX_TOKENS, top_k, n_experts)
    stacks = _experts(n_experts, d, inter, True, seed=30)
    tokens = _randn(t, d, seed=33, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=34)
    full = grouped_moe(tokens, experts, weights, *stacks, limit=10.0)
    for i in (0, t - 1):
        alone = grouped_moe(tokens[i:i + 1], experts[i:i + 1], weights[i:i + 1], *stacks, limit=10.0)
        assert torch.equal(alone, full[i:i + 1])


def test_rows_formulation_takes_the_tokens_whose_experts_see_few_rows(monkeypatch):
    """The rows formulation always takes up to MOE_ROWS_MAX_TOKENS tokens (a step, DSpark's verify and draft), and
    more while the chosen experts see at most ROWS_PER_EXPERT rows each: a 32-token batch over 384 experts, not
    over 32."""
    from modeling_deepseek_v41.kernels.triton import moe

    assert moe.rows_token_limit(6, 32) == MOE_ROWS_MAX_TOKENS and moe.rows_token_limit(6, 6) == MOE_ROWS_MAX_TOKENS
    assert 32 < moe.rows_token_limit(6, 384) < 256
    calls = []
    monkeypatch.setattr(moe, "rows_moe", lambda *args, **kwargs: calls.append(args[0].shape[0]) or
                        rows_moe(*args, **kwargs))
    n_experts, d, inter, top_k = 64, 64, 64, 2
    stacks = _experts(n_experts, d, inter, True, seed=70)
    for t in (12, 60):
        tokens = _randn(t, d, seed=71, dtype=torch.bfloat16)
        experts, weights = _routing(t, n_experts, top_k, seed=72)
        grouped_moe(tokens, experts, weights, *stacks, limit=10.0)
    assert calls == [12]  # 24 pairs over 64 experts take the rows; 120 pairs (2.2 rows per expert) the tiles


@pytest.mark.parametrize("t", [3, 19])
def test_grouped_moe_adds_the_shared_expert_in_its_last_launch(t):
    """With the shared expert's output the grouped MoE returns the layer's output: the routed sum plus it, rounded
    to its dtype, the bits of adding and casting after the call (both formulations)."""
    n_experts, d, inter, top_k = 6, 64, 64, 3
    stacks = _experts(n_experts, d, inter, True, seed=60)
    tokens = _randn(t, d, seed=61, dtype=torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=62)
    shared = _randn(t, d, seed=63, dtype=torch.bfloat16)
    routed = grouped_moe(tokens, experts, weights, *stacks, limit=10.0)
    out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, shared=shared)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (routed + shared).to(torch.bfloat16))


def test_expert_blocks_cover_every_pair_once():
    experts = torch.tensor([[3, 0], [3, 1], [3, 0], [2, 3], [3, 1]], device=DEVICE)
    pair_of_row, block_expert, start, end = expert_blocks(experts, 5, block_rows=2)
    assert block_expert.shape[0] == min(5, 10) + 5  # the capacity bound from the shapes
    flat = experts.reshape(-1)
    seen = []
    for e, a, b in zip(block_expert.tolist(), start.tolist(), end.tolist()):
        assert 0 <= b - a <= 2
        for r in range(a, b):
            assert flat[pair_of_row[r]].item() == e
            seen.append(pair_of_row[r].item())
    assert sorted(seen) == list(range(10))


# --- the GPU at the released widths (hidden 5120, q_lora 1280, 64 x 512 heads, o_lora 1024 x 8 groups,
# --- moe_intermediate 2304, 384 experts, top-6) --------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="compiled kernels at the released widths need a CUDA GPU")
RELEASED_FP8 = [(1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120)]


def _random_fp8(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(115, 121, (triton.cdiv(n, 32), triton.cdiv(k, 32)), device="cuda", generator=g)
    return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)


def _random_fp4(n, k, seed, experts=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if experts is None else (experts,)
    packed = torch.randint(-128, 128, (*lead, n, k // 2), device="cuda", generator=g, dtype=torch.int8)
    s = torch.randint(118, 124, (*lead, n, k // 32), device="cuda", generator=g).to(torch.uint8)
    return packed, s.view(torch.float8_e8m0fnu)


@cuda_only
@pytest.mark.parametrize("n,k", RELEASED_FP8)
@pytest.mark.parametrize("m", [1, 16, 64, 256, 300])
def test_cuda_fp8_linear_released_shapes(n, k, m):
    """Default: exact bf16 dots (decode-sized) or an exact bf16 scratch weight through cuBLAS (prefill-sized);
    fp8_dot=True: FP8 tensor cores."""
    w, s = _random_fp8(n, k, seed=n + k)
    x = _randn(m, k, seed=m, dtype=torch.float32)
    ref = _emulated_linear(x, w, s, "fp8")
    assert _rel(fp8_linear(x, w, s), ref) < FP32_BOUND
    assert _rel(fp8_linear(x, w, s, fp8_dot=True), ref) < FP8_DOT_BOUND
    xb = x.to(torch.bfloat16)
    _assert_close_to_emulation(fp8_linear(xb, w, s, fp8_dot=False), _emulated_linear(xb, w, s, "fp8"),
                               torch.bfloat16)


@cuda_only
@pytest.mark.parametrize("n,k", [(2304, 5120), (5120, 2304)])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_cuda_fp4_linear_released_shapes(n, k, m):
    w, s = _random_fp4(n, k, seed=n)
    x = _randn(m, k, seed=m, dtype=torch.float32)
    ref = _emulated_linear(x, w, s, "fp4")
    assert _rel(fp4_linear(x, w, s), ref) < FP32_BOUND
    assert _rel(fp8_row_linear(x, fp4_to_fp8_weight(w), s), ref) < FP32_BOUND
    assert _rel(fp4_linear(x, w, s, fp8_dot=True), ref) < FP8_DOT_BOUND


@cuda_only
def test_cuda_linears_batch_invariant_released_shapes():
    w, s = _random_fp8(1280, 5120, seed=1)
    w4, s4 = _random_fp4(2304, 5120, seed=2)
    wd = _randn(5120, 5120, seed=3, scale=0.02, dtype=torch.bfloat16)
    x = _randn(DECODE_MAX_ROWS, 5120, seed=4, dtype=torch.bfloat16)
    _check_batch_invariance(lambda t: fp8_linear(t, w, s), x)
    _check_batch_invariance(lambda t: fp4_linear(t, w4, s4), x)
    _check_batch_invariance(lambda t: dense_linear(t, wd), x)
    _check_batch_invariance(lambda t: dense_linear(t, wd.float()), x[:64].float())


def _released_experts(n_experts, seed):
    w1, s1 = _random_fp4(2304, 5120, seed, n_experts)
    w3, s3 = _random_fp4(2304, 5120, seed + 1, n_experts)
    w2, s2 = _random_fp4(5120, 2304, seed + 2, n_experts)
    return w1, s1, w3, s3, w2, s2


@cuda_only
@pytest.mark.parametrize("t", [1, 16, 64])
def test_cuda_grouped_moe_released_shapes(t):
    stacks = _released_experts(384, seed=40)
    tokens = _randn(t, 5120, seed=41, dtype=torch.bfloat16)
    experts, weights = _routing(t, 384, 6, seed=42)
    ref = _emulated_moe(tokens, experts, weights, stacks, limit=10.0, chunk=2)
    assert _rel(grouped_moe(tokens, experts, weights, *stacks, limit=10.0, fp8_dot=False), ref) < 5e-3
    assert _rel(grouped_moe(tokens, experts, weights, *stacks, limit=10.0, f16_slices=True), ref) < 5e-3
    assert _rel(grouped_moe(tokens, experts, weights, *stacks, limit=10.0, f16_slices=False), ref) < 5e-3
    assert _rel(grouped_moe(tokens, experts, weights, *stacks, limit=10.0, fp8_dot=True), ref) < 5e-3


@cuda_only
def test_cuda_grouped_gemm_moe_released_shapes():
    """A prefill's 384 experts through torch's grouped GEMM (in groups of experts) give the FP4 tiles' numbers up to
    fp32 summation order (the tiles are checked against the emulation above)."""
    stacks = _released_experts(384, seed=45)
    tokens = _randn(1024, 5120, seed=46, dtype=torch.bfloat16)
    experts, weights = _routing(1024, 384, 6, seed=47)
    out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, grouped_gemm=True)
    assert _rel(out, grouped_moe(tokens, experts, weights, *stacks, limit=10.0, grouped_gemm=False)) < 2e-3


@cuda_only
def test_cuda_grouped_moe_batch_invariant_and_capturable():
    stacks = _released_experts(384, seed=50)
    t = 256
    tokens = _randn(t, 5120, seed=51, dtype=torch.bfloat16)
    experts, weights = _routing(t, 384, 6, seed=52)
    for count in (MOE_ROWS_MAX_TOKENS, t):  # the rows formulation, then the tiles (forced for the single rows)
        rows = count <= MOE_ROWS_MAX_TOKENS
        full = grouped_moe(tokens[:count], experts[:count], weights[:count], *stacks, limit=10.0, rows=rows)
        for i in range(0, count, 3 if rows else 37):
            alone = grouped_moe(tokens[i:i + 1], experts[i:i + 1], weights[i:i + 1], *stacks, limit=10.0, rows=rows)
            assert torch.equal(alone, full[i:i + 1])
    static = (tokens.clone(), experts.clone(), weights.clone())
    grouped_moe(*static, *stacks, limit=10.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_moe(*static, *stacks, limit=10.0)
    new_tokens = _randn(t, 5120, seed=53, dtype=torch.bfloat16)
    new_experts, new_weights = _routing(t, 384, 6, seed=54)
    static[0].copy_(new_tokens), static[1].copy_(new_experts), static[2].copy_(new_weights)
    graph.replay()
    assert torch.equal(out, grouped_moe(new_tokens, new_experts, new_weights, *stacks, limit=10.0))
