"""The FP8 linears of decode sizes on the tensor cores (Gluon, Hopper's mma.sync): out [M, N] = QDQ(x) [M, K] @ W^T for
W e4m3 [N, K] with E8M0 scales per 32 x 32 tile, one weight or a pair on one input in one launch.

mma_v2 (m16n8k16, fp16 in, fp32 accumulators) takes the weights as A and the rows as B: a lane holds, per 32-column
group, 8 bytes of each of two weight rows (as shipped: lane t, columns 8t to 8t + 7), byte i at k = (i & 1) + 2t + 8 (i
>> 1 & 1) + 16 (i >> 2), so consecutive bytes are k's neighbours and one conversion (cvt.rn.f16x2.e4m3x2) makes each
fp16 pair of the fragment. The activations arrive as e4m3 values in fp16 at common.mma_position with fp32 power-of-two
scales per 32 columns: exact products, each group's fp32 dot scaled by both scales. A program takes 8, 16 or 32 rows
(the MMA's N); each output is its own row's dot, and the split of K depends on the weights' shapes only and is summed in
split order by the last program of each tile and row block (the rows kernel's arrive-last scheme), so a row's result
does not depend on the other rows or their count: batch invariant at every decode size. Up to 8 rows the kernel QDQs the
raw rows itself (each warp one group of a slice, shared through 2 KB of shared memory), so a decode step's linears need
no QDQ launch of their own; past 8, one QDQ launch writes them at mma_position. Offline (sm_90, Triton 3.6): 2.7 SASS
instructions per weight byte for up to 8 rows with the QDQ (2.0 without), against 3.8 for the CUDA-core rows kernel at
one row (its QDQ inside) and 11.1 at six. Launched like the Triton kernels, PDL included (mma_common.wait_for_inputs).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .common import e8m0_byte_value, pow2_ceil_scale
from .mma_common import (A_OPERAND, B_OPERAND, MMA, SLICE, activations_layout, linear_plan, split_groups,
                         store_split, wait_for_inputs)
from .quant import fp8_act_quant
from .workspace import split_buffers
from .launch import launch_options

_SLICE = gl.constexpr(SLICE)
PREFETCH = False  # the kernel's PREFETCH when a call does not say (realwidth.py --prefetch times it)

# int32 of four e4m3 bytes -> four fp16 (byte i -> output i): bytes 0-1 and 2-3 each one conversion
_BYTES_ASM = gl.constexpr("""
{
.reg .b16 lo, hi;
.reg .b32 p, q;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {$0, $1}, p;
mov.b32 {$2, $3}, q;
}
""")


@gluon.jit
def _group_dot(acc, w01, w23, xg, sw, sx, BN: gl.constexpr, BM: gl.constexpr):
    """acc + (one group's weights [BN, 32] from a lane's two words [BN, 4] . xg [32, BM]) x scales."""
    v0, v1, v2, v3 = gl.inline_asm_elementwise(_BYTES_ASM, "=h,=h,=h,=h,r", [w01], (gl.float16,) * 4, True, 1)
    v4, v5, v6, v7 = gl.inline_asm_elementwise(_BYTES_ASM, "=h,=h,=h,=h,r", [w23], (gl.float16,) * 4, True, 1)
    # [n, t, a, b, c] (byte i = a + 2b + 4c) -> [n, c, b, t, a] = [n, k], k = 16c + 8b + 2t + a
    values = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    values = gl.convert_layout(gl.reshape(gl.permute(values, [0, 4, 3, 1, 2]), [BN, 32]), A_OPERAND)
    d = mma_v2(values, xg, gl.zeros([BN, BM], gl.float32, MMA))
    return acc + d * (sw[:, None] * sx[None, :])


@gluon.jit
def _quantized_slice(xv):
    """A slice's activations [BM, 4 t, 4 g, 8 i] (fp32, column 32 g + 8 t + i) -> (their e4m3 values as fp16, the
    scales [BM, 4 g]): quant's FP8 activation QDQ (common.qdq_groups: the scale from the bits of amax x fp32(1/448),
    the values divided by it, clamped, rounded by the conversion instruction) per row and 32-column group."""
    scale = pow2_ceil_scale(gl.maximum(gl.max(gl.max(gl.abs(xv), axis=3), axis=1), 1e-4))
    q = gl.minimum(gl.maximum(xv / gl.expand_dims(gl.expand_dims(scale, 1), 3), -448.0), 448.0)
    return q.to(gl.float8e4nv).to(gl.float16), scale


@gluon.jit
def _fp8_mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits,
                    stride_xm, stride_xsm, stride_wn, stride_sn, w2_ptr, s2_ptr, out2_ptr, N2, tiles1,
                    BN: gl.constexpr, BM: gl.constexpr, QDQ: gl.constexpr, PREFETCH: gl.constexpr):
    """out[m, n] = sum over k of QDQ(x)[m, k] w[n, k]: this program's BN weight rows, BM rows and split of K; the
    last program of a (tile, row block) sums the splits' partials in split order. QDQ: x holds the raw rows, QDQ'd
    as they are read (every program repeats it for its slices: worth it for a few rows, where a launch of its own
    would cost more than the linear); else x holds their e4m3 values at mma_position and xs their scales. Tiles
    past `tiles1` take a second weight w2 [N2, K] (scales s2, output out2, the same strides) on the same rows. A
    row's sums are the same at any BM and either way (each MMA output is its own row's dot): batch invariant.
    PREFETCH: the next slice's weight words are loaded before this slice's MMAs (the last loads itself again)."""
    wait_for_inputs()
    # [128 rows, 4 t, 4 groups, 2 words]: lane 4 (row % 8) + t holds rows r and r + 8 of its warp's 16-row tile
    # (and + 64), its 8 bytes of each group
    WORDS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0], [64, 0, 0, 0]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[128, 4, 4, 2])
    XL: gl.constexpr = activations_layout(BM)
    # the raw rows QDQ'd one group per warp (each warp's share of the work, not all of it), then shared
    XQ: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[0, 0, 1, 0], [0, 0, 2, 0]], block_bases=[], shape=[8, 4, 4, 8])
    gl.static_assert(BN == 128, "the words' layout is written for 128 weight rows per program")
    tile = gl.program_id(0)
    part_ptr += (tile >= tiles1).to(gl.int64) * splits * M * N  # the second weight's partials after the first's
    if tile >= tiles1:
        w_ptr, s_ptr, out_ptr, N = w2_ptr, s2_ptr, out2_ptr, N2
        tile -= tiles1
    n0 = tile * BN
    pid_s = gl.program_id(1)
    k_start = pid_s * k_chunk
    k_stop = gl.minimum(k_start + k_chunk, K)
    WS: gl.constexpr = gl.SliceLayout(3, WORDS)
    n_w = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WS))), N - 1)
    t_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WS)))
    g_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WS)))
    h_w = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WORDS))))
    # lane t's 8 bytes of group g at byte 32 g + 8 t of the slice: words 8 g + 2 t and the next
    w_rows = (w_ptr + n_w[:, None, None, None].to(gl.int64) * stride_wn + 2 * t_w[None, :, None, None]
              + 8 * g_w[None, None, :, None] + h_w[None, None, None, :])
    XS: gl.constexpr = gl.SliceLayout(3, XL)
    row0 = gl.program_id(2) * BM
    r_x = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, XS)))
    t_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XS)))
    g_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, XS)))
    i_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    if QDQ:  # lane t's values of group g: the raw row's columns 32 g + 8 t to 32 g + 8 t + 7
        gl.static_assert(BM == 8, "the rows QDQ'd in the kernel are 8 per program")
        XQS: gl.constexpr = gl.SliceLayout(3, XQ)
        r_q = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, XQS)))
        t_q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XQS)))
        g_q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, XQS)))
        i_q = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XQ))))
        x_rows = (x_ptr + r_q[:, None, None, None].to(gl.int64) * stride_xm + 8 * t_q[None, :, None, None]
                  + 32 * g_q[None, None, :, None] + i_q[None, None, None, :])
        x_ok = (r_q < M)[:, None, None, None] & (i_q >= 0)[None, None, None, :]
    else:  # the same values stored at mma_position: adjacent
        x_rows = (x_ptr + r_x[:, None, None, None].to(gl.int64) * stride_xm + 32 * t_x[None, :, None, None]
                  + 8 * g_x[None, None, :, None] + i_x[None, None, None, :])
        x_ok = (r_x < M)[:, None, None, None] & (i_x >= 0)[None, None, None, :]
    n_c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    r_c = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    s_rows = s_ptr + (gl.minimum(n_c, N - 1) // 32).to(gl.int64) * stride_sn
    xs_rows = xs_ptr + r_c.to(gl.int64) * stride_xsm
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    if PREFETCH:
        words = gl.load(w_rows + k_start // 4)
    for k in range(k_start, k_stop, _SLICE):
        if PREFETCH:
            words_next = gl.load(w_rows + gl.minimum(k + _SLICE, k_stop - _SLICE) // 4)
        else:
            words = gl.load(w_rows + k // 4)  # [BN, 4 lanes, 4 groups, 2 words]
        lo, hi = gl.split(words)  # bytes 0-3 and 4-7 of each lane's group
        lo0, lo1, lo2, lo3 = split_groups(gl.reshape(lo, [BN, 4, 2, 2]))
        hi0, hi1, hi2, hi3 = split_groups(gl.reshape(hi, [BN, 4, 2, 2]))
        if QDQ:
            codes, scales = _quantized_slice(gl.load(x_rows + k, mask=x_ok, other=0.0).to(gl.float32))
            xs4 = gl.convert_layout(codes, XL)
            scales = gl.convert_layout(scales, gl.SliceLayout(1, gl.SliceLayout(3, XL)))
            sx0, sx1, sx2, sx3 = split_groups(gl.reshape(scales, [BM, 2, 2]))
        else:
            xs4 = gl.load(x_rows + k, mask=x_ok, other=0.0)  # [BM, 4, 4, 8]
        x0, x1, x2, x3 = split_groups(gl.reshape(gl.permute(xs4, [0, 1, 3, 2]), [BM, 4, 8, 2, 2]))
        for g in gl.static_range(4):
            w01 = lo0 if g == 0 else lo1 if g == 1 else lo2 if g == 2 else lo3
            w23 = hi0 if g == 0 else hi1 if g == 1 else hi2 if g == 2 else hi3
            xq = x0 if g == 0 else x1 if g == 1 else x2 if g == 2 else x3
            # [n, t, a, b, c] (i = a + 2b + 4c: k = 16c + 8b + 2t + a) -> [c, b, t, a, n] = [k, n]
            xg = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(xq, [BM, 4, 2, 2, 2]), [2, 3, 1, 4, 0]),
                                              [32, BM]), B_OPERAND)
            sw = e8m0_byte_value(gl.load(s_rows + k // 32 + g))
            if QDQ:
                sx = gl.convert_layout(sx0 if g == 0 else sx1 if g == 1 else sx2 if g == 2 else sx3,
                                       gl.SliceLayout(0, MMA))
            else:
                sx = gl.load(xs_rows + k // 32 + g, mask=r_c < M, other=0.0)
            acc = _group_dot(acc, w01, w23, xg, sw, sx, BN, BM)
        if PREFETCH:
            words = words_next
    store_split(acc, out_ptr, part_ptr, count_ptr, r_c, n_c, M, N, pid_s, splits)


def fp8_mma_linear(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                   second: tuple[torch.Tensor, torch.Tensor] | None = None, prefetch: bool | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[M, N] = QDQ(rows) [M, K] @ weight^T (rows bf16/fp32), weight e4m3 [N, K] as shipped with E8M0 scales
    [N/32, K/32]; with second = (weight2, scale2) of the same K, both products from one launch. Programs take
    mma_common.block_rows(M) rows; the split of K follows from the weights' shapes alone. prefetch: the kernel's
    PREFETCH (None: the module's)."""
    m, k = rows.shape
    n = weight.shape[0]
    w2, s2 = second if second is not None else (weight, scale)
    if (k % SLICE or weight.shape[1] != k or w2.shape[1] != k or not (weight.is_contiguous() and w2.is_contiguous())
            or rows.stride(-1) != 1 or rows.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError(f"the tensor-core linear takes bf16/fp32 rows contiguous along K and contiguous weights of "
                         f"whole {SLICE}-column slices; got {rows.dtype} rows, K {k}")
    n2 = w2.shape[0] if second is not None else 0
    tiles1, tiles, per, splits, bm = linear_plan(m, n, n2, k // SLICE)
    row_blocks = triton.cdiv(m, bm)
    out = torch.empty(m, n, dtype=out_dtype, device=rows.device)
    out2 = torch.empty(m, n2, dtype=out_dtype, device=rows.device) if second is not None else out
    part, count = split_buffers(splits, (m, n + n2), tiles * row_blocks, rows.device)
    words, words2 = weight.view(torch.int32), w2.view(torch.int32)
    s, s2 = scale.view(torch.uint8), s2.view(torch.uint8)
    qdq = bm == 8  # up to 8 rows: QDQ'd in the kernel (no launch of its own); more: once, by the QDQ launch
    x, xs = (rows, rows) if qdq else fp8_act_quant(rows, torch.float16, mma_order=True)
    _fp8_mma_kernel[(tiles, splits, row_blocks)](x, xs, words, s, out, part, count, m, n, k, per * SLICE, splits,
                                                 x.stride(0), xs.stride(0), words.stride(0), s.stride(0), words2, s2,
                                                 out2, n2, tiles1, BN=128, BM=bm, QDQ=qdq,
                                                 PREFETCH=PREFETCH if prefetch is None else prefetch,
                                                 num_warps=4, **launch_options())
    return (out, out2) if second is not None else out
