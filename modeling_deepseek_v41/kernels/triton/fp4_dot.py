"""Packed FP4 weights times bf16 activations on the tensor cores, each weight's E8M0 scale folded into its value.

An e2m1 value times a power of two is exact in bf16 (two significant bits, fp32's exponent range), as are the QDQ'd
activations (e4m3 values times powers of two), so one bf16 dot per BK columns with fp32 accumulation gives exact
products whatever the scales; no per-32-column rescale of the accumulator. The nibbles become bf16 with a few
integer operations: s|e1 e0|m placed as the bf16 bits s|0..0 e1 e0|m 0.. is the e2m1 value times 2^-126 for every
code (normal and subnormal alike), and packed bf16 multiplies by powers of two whose product is 2^(scale byte - 1)
make it value x scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import e8m0_byte_value, fp4_nibble_value


def _nibble_pair_ptx(i: int) -> str:
    """PTX for nibbles i and i + 4 of word $8: their bits s|e1 e0|m placed as bf16 bits (value x 2^-126, see the
    module docstring), times the multipliers $9 and $10, into outputs $i and $(i+4)."""
    value_shift, sign_shift = 6 - 4 * i, 12 - 4 * i
    lines = [f"and.b32 a, $8, 0x{0x00070007 << 4 * i:08X};", f"and.b32 s, $8, 0x{0x00080008 << 4 * i:08X};",
             f"shl.b32 a, a, {value_shift};" if value_shift >= 0 else f"shr.b32 a, a, {-value_shift};"]
    if sign_shift:
        lines.append(f"shl.b32 s, s, {sign_shift};")
    lines += ["or.b32 p, a, s;", "mul.rn.bf16x2 p, p, $9;", "mul.rn.bf16x2 p, p, $10;",
              f"mov.b32 {{${i}, ${i + 4}}}, p;"]
    return "\n".join(lines)


# in: $8 a word of eight nibbles (element 8w + i is nibble i), $9 and $10 bf16x2 pairs of powers of two whose
# product is 2^(S-1) (2^(S-1) and 1, or 2^127 and 2^(S-128) past bf16's largest power, S > 128);
# out: $0..$7 nibble i's value x 2^(S-127) in bf16 (pairs i, i + 4 computed in one 32-bit register)
_FP4_BF16_ASM = tl.constexpr("{\n.reg .b32 a, s, p;\n" + "\n".join(_nibble_pair_ptx(i) for i in range(4)) + "\n}")


@triton.jit
def _scale_operands(byte, IEEE: tl.constexpr):
    """What the nibbles of a 32-column group are multiplied by, from its E8M0 bytes [R, G]: the PTX's two bf16x2
    powers of two (int32), or in the interpreter the fp32 scale (twice, x 2^6 undoing fp4_nibble_value's 2^-6)."""
    if IEEE:
        first = 64.0 * e8m0_byte_value(byte)
        second = first
    else:
        s = byte.to(tl.int32) & 0xFF
        first = tl.where(s > 128, 254, s + 126) << 7  # bf16 bits of 2^127 or of 2^(S-1)
        second = tl.where(s > 128, s - 1, 127) << 7  # of 2^(S-128) or of 1
        first = first | (first << 16)
        second = second | (second << 16)
    return first, second


@triton.jit
def _per_word(group_values, W: tl.constexpr):
    """[R, W/4] values of the 32-column groups repeated for their four words: [R, W]."""
    R: tl.constexpr = group_values.shape[0]
    return tl.reshape(tl.broadcast_to(group_values[:, :, None], [R, W // 4, 4]), [R, W])


@triton.jit
def _scaled_nibbles(word, first, second, IEEE: tl.constexpr):
    """The 8 nibbles of int32 words [R, W] times their words' scales (_scale_operands, per word) as 8 tensors
    [R, W]: bf16 from the PTX above, in the interpreter (which runs no PTX) the same values in fp32."""
    if IEEE:
        v0, v1, v2, v3 = (fp4_nibble_value(word, 0) * first, fp4_nibble_value(word, 1) * first,
                          fp4_nibble_value(word, 2) * first, fp4_nibble_value(word, 3) * first)
        v4, v5, v6, v7 = (fp4_nibble_value(word, 4) * first, fp4_nibble_value(word, 5) * first,
                          fp4_nibble_value(word, 6) * first, fp4_nibble_value(word, 7) * first)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _FP4_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [word, first, second], (tl.bfloat16,) * 8, True, 1)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def fp4_scaled_dot(acc, w_ptr, s_ptr, x_ptr, rows_n, rows, k_start, k_stop, stride_wn, stride_sn, stride_xm,
                   BK: tl.constexpr, IEEE: tl.constexpr):
    """acc[BN, BM] += W[rows_n, k_start:k_stop] @ X[rows, k_start:k_stop]^T, one dot per BK columns. w_ptr views the
    packed bytes as int32 words (stride_wn in words), s_ptr the E8M0 bytes per (row, 32 columns); x is QDQ'd bf16
    (fp32 in the interpreter). No masks: rows_n and rows are valid rows (clamped by the caller), and k_stop -
    k_start is a multiple of BK."""
    W: tl.constexpr = BK // 8
    BN: tl.constexpr = rows_n.shape[0]
    words = rows_n[:, None] * stride_wn + tl.arange(0, W)[None, :]
    scales = rows_n[:, None] * stride_sn + tl.arange(0, W // 4)[None, :]
    x_cols = rows[:, None] * stride_xm + tl.arange(0, BK)[None, :]  # [BM, BK]: K contiguous, vector loads
    for k in range(k_start, k_stop, BK):
        word = tl.load(w_ptr + tl.multiple_of(k // 8, 4) + words)
        # the multipliers from one byte per 32 columns, then repeated for its four words (loading the words' byte
        # offsets directly gave the unpacked tile a layout stored to shared memory 16 bits at a time)
        first, second = _scale_operands(tl.load(s_ptr + k // 32 + scales), IEEE)
        v0, v1, v2, v3, v4, v5, v6, v7 = _scaled_nibbles(word, _per_word(first, W), _per_word(second, W), IEEE)
        # tl.join adds its pair as the last (fastest) axis: this tree puts element 8w + i at position 8w + i
        w = tl.reshape(tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))),
                       [BN, BK])
        x = tl.trans(tl.load(x_ptr + k + x_cols))
        if IEEE:
            acc = tl.dot(w, x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    return acc


def slice_width(k: int, bk: int) -> int:
    """The widest of bk, bk/2, ... 32 that divides k (k a multiple of 32): the FP4 kernels' slices need no mask."""
    while k % bk:
        bk //= 2
    return bk
