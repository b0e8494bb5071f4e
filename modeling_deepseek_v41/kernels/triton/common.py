"""Triton helpers shared by the kernels: the bit formats (e4m3 rounding, E8M0 power-of-two scales, e2m1 codes)
and the loaders of one 32-wide K slice of a weight in each storage format.

Imports only torch and triton; the model imports this package lazily, when a CUDA tensor arrives.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

FMT_DENSE = 0  # bf16/fp32 weight [N, K]
FMT_FP8_TILE = 1  # e4m3 [N, K], E8M0 scale per 32x32 tile [ceil(N/32), ceil(K/32)]
FMT_FP4_ROW = 2  # packed e2m1 [N, K/2] (even element in the low nibble), E8M0 scale per (row, 32) [N, K/32]
FMT_FP8_ROW = 3  # e4m3 [N, K] re-encoded from FP4 (values exact), E8M0 scale per (row, 32) [N, K/32]
# the same codes as compile-time constants, for the kernels' branches on their WFMT argument (the launches pass ints)
DENSE, FP8_TILE, FP4_ROW = tl.constexpr(FMT_DENSE), tl.constexpr(FMT_FP8_TILE), tl.constexpr(FMT_FP4_ROW)
# read when the kernels are defined, as triton.jit does to pick the interpreter (without knobs: the variable it reads)
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs")
                           else os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def round_e4m3(v):
    """fp32 values (already within [-448, 448]) rounded to the nearest e4m3 value, ties to even, as fp32.

    Compiled, the conversion instruction; interpreted, integer arithmetic (the interpreter's conversion rounds
    otherwise). The result is exact in e4m3, so a later cast to float8 is exact on every backend."""
    if INTERPRETED:
        a = tl.abs(v)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        # below 2^-6 the grid is multiples of 2^-9: adding 2^14 leaves exactly that quantum (ties to even)
        steps = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        sub = steps.to(tl.float32) * 0.001953125
        r = tl.where(a < 0.015625, sub, normal)
        out = tl.where(v < 0, -r, r)
    else:
        out = v.to(tl.float8e4nv).to(tl.float32)
    return out


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE rounding to nearest even: compiled, the conversion instruction; interpreted, bf16 in integer
    arithmetic (the interpreter rounds half up). A tensor already in DTYPE is returned as it is."""
    if x.dtype == DTYPE:
        out = x
    elif DTYPE == tl.bfloat16 and INTERPRETED:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        out = x.to(DTYPE)
    return out


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


# Triton's own max combine where it exists: the interpreter reduces with it in one numpy call
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _larger)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    """max along `axis` (tl.reduce: see abs_max)."""
    return tl.reduce(x, axis, _MAX_COMBINE)


# Triton's own sum combine where it exists: the interpreter reduces with it in one numpy call
_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    """sum along `axis` (tl.reduce: see abs_max)."""
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def prefix_sum(x, axis: tl.constexpr):
    """inclusive cumulative sum along `axis` (tl.associative_scan: tl.cumsum is compiled-only, see abs_max)."""
    return tl.associative_scan(x, axis, _SUM_COMBINE)


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """max |x| along `axis`. tl.reduce rather than tl.max: tl.max is fixed as compiled-only when triton was
    imported before TRITON_INTERPRET was set (the model package imports it), tl.reduce is patched either way."""
    return tl.reduce(tl.abs(x), axis, _MAX_COMBINE)


@triton.jit
def pow2_ceil_scale(amax, INV_MAX: tl.constexpr = 0.002232142857142857):
    """2^ceil(log2(amax / max)) from the bits of the fp32 product amax * fp32(1/max) (numerics._pow2_ceil_scale);
    INV_MAX 1/max, by default 1/448 (FP8)."""
    product = amax * INV_MAX
    bits = product.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def qdq_groups(v, BLOCK: tl.constexpr):
    """The FP8 activation QDQ (numerics.fp8_act_qdq) of a [BLOCK] row in fp32: per 32 values, a power-of-two
    scale, values rounded to e4m3. Returns (codes as fp32 e4m3 values [BLOCK/32, 32], scales [BLOCK/32])."""
    groups = tl.reshape(v.to(tl.float32), [BLOCK // 32, 32])
    scale = pow2_ceil_scale(tl.maximum(abs_max(groups, 1), 1e-4))
    return round_e4m3(tl.minimum(tl.maximum(groups / scale[:, None], -448.0), 448.0)), scale


@triton.jit
def e2m1_value(code):
    """fp32 value of 4-bit e2m1 codes (int32, bit 3 = sign): 0, .5, 1, 1.5, 2, 3, 4, 6 (all exact in e4m3).

    The code's exponent and mantissa bits placed at the bottom of an fp16's exponent and the top of its mantissa
    give 2^-14 times the value, subnormal codes included (fp16 conversions keep subnormals)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_value(s_ptrs, mask):
    """fp32 power of two from E8M0 bytes (2^(byte - 127); byte 0 is 2^-127, a subnormal fp32)."""
    return e8m0_byte_value(tl.load(s_ptrs, mask=mask, other=127))


@triton.jit
def e8m0_byte_value(byte):
    """e8m0_value of loaded E8M0 bytes (any integer dtype): the byte as an fp32 exponent field, byte 0 as the bits
    of 2^-127 (1 << 22, the largest subnormal power of two), which no other byte's bits fall below."""
    return tl.maximum((byte.to(tl.int32) & 0xFF) << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def k_slice(k0, WFMT: tl.constexpr):
    """Column indices of one 32-wide K slice starting at k0. For packed FP4 weights the slice is read in the order
    (even elements, odd elements) so that each half is one contiguous run of bytes; activations are read in the
    same order, so the dot is unchanged (a sum has no order beyond fp32 rounding)."""
    r = tl.arange(0, 32)
    if WFMT == FP4_ROW:
        cols = k0 + (r % 16) * 2 + r // 16
    else:
        cols = k0 + r
    return cols


@triton.jit
def weight_scale(s_ptr, offs_n, k0, N, K, stride_sn, WFMT: tl.constexpr):
    """The scale [BN] of each weight row for the 32-wide slice at k0: E8M0 per 32x32 tile or per (row, 32); for
    packed FP4 times 2^6, undoing the 2^-6 of weight_slice's e4m3 encoding of the nibbles. A slice past K reads
    no scale (1.0): past the row lies another row's scale or unowned memory, and 0 x inf would be NaN."""
    if WFMT == FP8_TILE:
        rows = offs_n // 32
    else:
        rows = offs_n
    scale = e8m0_value(s_ptr + rows * stride_sn + k0 // 32, (offs_n < N) & (offs_n * 0 + k0 < K))
    if WFMT == FP4_ROW:
        scale = scale * 64.0
    return scale


@triton.jit
def weight_slice(w_ptr, offs_n, k0, N, K, stride_wn, WFMT: tl.constexpr):
    """One [BN, 32] slice of the stored weight at columns k0.. (in k_slice's order), unscaled: the dense values,
    or e4m3 values. Packed FP4 nibbles s|e1 e0|m become the e4m3 byte s|0 0 e1 e0|m 0 0, whose value is the e2m1
    value times 2^-6 for every code (normal and subnormal alike): exact, and four integer operations."""
    r = tl.arange(0, 32)
    mask = (offs_n < N)[:, None] & ((k0 + r)[None, :] < K)
    if WFMT == FP4_ROW:
        # bytes k0/2 + (r % 16): the first 16 columns take the low nibbles (even k), the last 16 the high (odd k)
        byte = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 2 + r % 16)[None, :], mask=mask, other=0)
        nibble = (byte.to(tl.int32) >> ((r // 16) * 4)[None, :]) & 15
        bits = ((nibble & 8) << 4) | ((nibble & 7) << 2)
        w = bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + r)[None, :], mask=mask, other=0.0)
    return w


@triton.jit
def act_slice_t(x_ptr, rows, row_mask, k0, K, stride_xm, WFMT: tl.constexpr):
    """The activations' [32, BM] slice (transposed: K by rows) at columns k0.., in the weight slice's order."""
    cols = k_slice(k0, WFMT)
    mask = (cols[:, None] < K) & row_mask[None, :]
    return tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None], mask=mask, other=0.0)


@triton.jit
def weight_tile(w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn, BK: tl.constexpr, WFMT: tl.constexpr):
    """The [BN, BK] tile at columns k0.. of a dense or e4m3 weight (not packed FP4) as fp32: dense values as stored,
    e4m3 ones times their power-of-two scales (exact). One contiguous run of bytes per row."""
    row_ok = offs_n < N
    c = tl.arange(0, BK)
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + c)[None, :],
                mask=row_ok[:, None] & ((k0 + c) < K)[None, :], other=0.0).to(tl.float32)
    if WFMT != DENSE:
        groups = k0 // 32 + tl.arange(0, BK // 32)
        scale_rows = offs_n // 32 if WFMT == FP8_TILE else offs_n
        # groups past K read no scale (1.0): past the row lies another row's scale or unowned memory, 0 x inf = NaN
        scale = e8m0_value(s_ptr + scale_rows[:, None] * stride_sn + groups[None, :],
                           row_ok[:, None] & (groups * 32 < K)[None, :])
        w = tl.reshape(tl.reshape(w, [offs_n.shape[0], BK // 32, 32]) * scale[:, :, None], [offs_n.shape[0], BK])
    return w


@triton.jit
def dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, row_mask, k_start, k_stop, N, K,
                stride_wn, stride_sn, stride_xm, stride_xsm,
                BK: tl.constexpr, WFMT: tl.constexpr, FP8_DOT: tl.constexpr, X_DTYPE: tl.constexpr,
                DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """acc[BN, BM] += W[offs_n, k_start:k_stop] @ X[rows, k_start:k_stop]^T, BK columns at a time, fixed order.

    Default: each [BN, BK] weight tile (packed FP4: its even and its odd columns) dequantized exactly to DOT_DTYPE in
    registers (e4m3/e2m1 times a power of two is exact in bf16) and multiplied in one tensor-core dot with the
    activations rounded to X_DTYPE (for quantized weights already exactly QDQ'd, so exact in bf16; for dense ones
    the weight's dtype, as F.linear(x.to(w.dtype), w) does): exact products, fp32 accumulation.
    FP8_DOT: e4m3 weight values (FP4 nibbles re-encoded to e4m3) times e4m3 activations (x_ptr, with fp32 scales per
    row and 32 at xs_ptr) on the FP8 tensor cores, 32 columns per dot, both power-of-two scales applied to each
    slice's fp32 result; Hopper's FP8 dots sum below fp32 precision."""
    for k in range(k_start, k_stop, BK):
        if FP8_DOT:
            for j in tl.static_range(BK // 32):
                k0 = k + j * 32
                w = weight_slice(w_ptr, offs_n, k0, N, K, stride_wn, WFMT)
                x = act_slice_t(x_ptr, rows, row_mask, k0, K, stride_xm, WFMT)
                ws = weight_scale(s_ptr, offs_n, k0, N, K, stride_sn, WFMT)
                xs = tl.load(xs_ptr + rows * stride_xsm + k0 // 32, mask=row_mask & (rows * 0 + k0 < K), other=1.0)
                if IEEE:  # the interpreter: the same e4m3 values in fp32
                    part = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(w, x)
                acc += part * (ws[:, None] * xs[None, :])
        elif WFMT == FP4_ROW:  # packed FP4: BK/2 bytes per row at once, the even and the odd columns one dot each
            half = tl.arange(0, BK // 2)
            row_ok = offs_n < N
            byte = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k // 2 + half)[None, :],
                           mask=row_ok[:, None] & ((k + 2 * half) < K)[None, :], other=0).to(tl.int32)
            groups = k // 32 + tl.arange(0, BK // 32)
            # 2^6 undoes the 2^-6 of the e4m3 encoding of the nibbles (see weight_slice)
            scale = 64.0 * e8m0_value(s_ptr + offs_n[:, None] * stride_sn + groups[None, :],
                                      row_ok[:, None] & (groups * 32 < K)[None, :])
            x_even = tl.load(x_ptr + rows[None, :] * stride_xm + (k + 2 * half)[:, None],
                             mask=((k + 2 * half)[:, None] < K) & row_mask[None, :], other=0.0)
            x_odd = tl.load(x_ptr + rows[None, :] * stride_xm + (k + 2 * half + 1)[:, None],
                            mask=((k + 2 * half + 1)[:, None] < K) & row_mask[None, :], other=0.0)
            for parity in tl.static_range(2):
                nibble = (byte >> (4 * parity)) & 15
                w = (((nibble & 8) << 4) | ((nibble & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
                w = tl.reshape(tl.reshape(w.to(tl.float32), [offs_n.shape[0], BK // 32, 16]) * scale[:, :, None],
                               [offs_n.shape[0], BK // 2]).to(DOT_DTYPE)
                if parity == 0:
                    x = cast(x_even, X_DTYPE).to(DOT_DTYPE)
                else:
                    x = cast(x_odd, X_DTYPE).to(DOT_DTYPE)
                if IEEE:
                    acc = tl.dot(w, x, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, x, acc)
        else:
            w = weight_tile(w_ptr, s_ptr, offs_n, k, N, K, stride_wn, stride_sn, BK, WFMT).to(DOT_DTYPE)
            cols = k + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[None, :] * stride_xm + cols[:, None],
                        mask=(cols[:, None] < K) & row_mask[None, :], other=0.0)
            x = cast(x, X_DTYPE).to(DOT_DTYPE)
            if IEEE:
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc)
    return acc


@triton.jit
def mma_position(c):
    """Where the tensor-core decode kernels (fp4_mma.py, fp8_mma.py) read activation column c: within its
    128-column slice, group g = c % 128 // 32 holds lanes t = c % 32 // 8 of 8 values each, read at 32 t + 8 g + i
    (i = c % 8), so that a lane's values of a slice are adjacent while it reads the weights' columns as shipped."""
    return (c // 128) * 128 + 32 * ((c % 32) // 8) + 8 * ((c % 128) // 32) + c % 8


# one int32 word of packed e2m1 (element i in nibble i) -> its 8 values x 2^-6 as fp16: each nibble s|e1 e0|m
# becomes the e4m3 byte s|0 0 e1 e0|m 0 0 (integer operations on 4 nibbles at a time), then the hardware's
# e4m3x2 -> f16x2 conversion; outputs in element order
_FP4_WORD_ASM = tl.constexpr("""
{
.reg .b32 e, o, t, e01, e23, o01, o23;
.reg .b16 h0, h1, g0, g1;
shl.b32 e, $8, 4;
shl.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
lop3.b32 e, e, 0x80808080, t, 0xEA;
shr.u32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
lop3.b32 o, $8, 0x80808080, t, 0xEA;
mov.b32 {h0, h1}, e;
mov.b32 {g0, g1}, o;
cvt.rn.f16x2.e4m3x2 e01, h0;
cvt.rn.f16x2.e4m3x2 e23, h1;
cvt.rn.f16x2.e4m3x2 o01, g0;
cvt.rn.f16x2.e4m3x2 o23, g1;
mov.b32 {$0, $2}, e01;
mov.b32 {$4, $6}, e23;
mov.b32 {$1, $3}, o01;
mov.b32 {$5, $7}, o23;
}
""")


@triton.jit
def fp4_nibble_value(word, i: tl.constexpr):
    """Nibble i of each int32 word of packed e2m1 as its value x 2^-6 in fp32 (the e4m3 byte s|0 0 e1 e0|m 0 0),
    what the PTX above computes, for the interpreter, which runs no PTX."""
    nibble = (word >> (4 * i)) & 15
    code = (((nibble & 8) << 4) | ((nibble & 7) << 2)).to(tl.uint8)
    return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def fp4_word_nibbles(word, IEEE: tl.constexpr):
    """The 8 nibbles of int32 words of packed e2m1 (nibble i is element 8w + i) as 8 tensors of values x 2^-6, in
    the words' own shape and layout (no shuffles): fp16 from the PTX above, in the interpreter fp32."""
    if IEEE:
        v0, v1, v2, v3 = fp4_nibble_value(word, 0), fp4_nibble_value(word, 1), fp4_nibble_value(word, 2), \
            fp4_nibble_value(word, 3)
        v4, v5, v6, v7 = fp4_nibble_value(word, 4), fp4_nibble_value(word, 5), fp4_nibble_value(word, 6), \
            fp4_nibble_value(word, 7)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _FP4_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [word], (tl.float16,) * 8, True, 1)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def fp4_word_values(word, IEEE: tl.constexpr):
    """[R, W] int32 words of packed e2m1 -> [R, 8W] values x 2^-6 in element order (element 8w + i is nibble i of
    word w): fp16 from the PTX above, or in the interpreter the same values in fp32."""
    v0, v1, v2, v3, v4, v5, v6, v7 = fp4_word_nibbles(word, IEEE)
    # tl.join adds its pair as the last (fastest) axis: the outermost join splits even from odd elements
    values = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(values, [word.shape[0], word.shape[1] * 8])


@triton.jit
def fp4_f16_dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, row_mask, k_start, k_stop, N, K,
                        stride_wn, stride_sn, stride_xm, stride_xsm, BK: tl.constexpr, IEEE: tl.constexpr):
    """acc[BN, BM] += W[offs_n, k_start:k_stop] @ X[rows, k_start:k_stop]^T for packed FP4 weights, exactly, with
    few operations per weight: w_ptr views the packed bytes as int32 words (stride_wn in words), each 32-column
    slice's four words per row become fp16 values x 2^-6 (fp4_word_values), and x arrives as its e4m3 values in
    fp16 (x_ptr) with fp32 power-of-two scales per row and 32 (xs_ptr). fp16 products of both are exact in fp32;
    each slice's dot is scaled by 2^6 x the weight's and the row's scale."""
    quad = tl.arange(0, 4)
    cols = tl.arange(0, 32)
    row_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * stride_wn + quad[None, :]
    x_rows = x_ptr + rows[None, :] * stride_xm + cols[:, None]
    for k in range(k_start, k_stop, BK):
        for j in tl.static_range(BK // 32):
            k0 = tl.multiple_of(k + j * 32, 32)
            live = (quad * 0 + k0) < K  # K is a multiple of 32: a slice is wholly inside or past the end
            word = tl.load(w_rows + k0 // 8, mask=row_ok[:, None] & live[None, :], other=0)
            w = fp4_word_values(word, IEEE)
            x = tl.load(x_rows + k0, mask=row_mask[None, :] & (cols * 0 + k0 < K)[:, None], other=0.0)
            ws = 64.0 * e8m0_value(s_ptr + offs_n * stride_sn + k0 // 32, row_ok & (offs_n * 0 + k0 < K))
            xs = tl.load(xs_ptr + rows * stride_xsm + k0 // 32, mask=row_mask & (rows * 0 + k0 < K), other=1.0)
            if IEEE:  # the interpreter: the same values in fp32
                part = tl.dot(w, x.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(w, x)
            acc += part * (ws[:, None] * xs[None, :])
    return acc
