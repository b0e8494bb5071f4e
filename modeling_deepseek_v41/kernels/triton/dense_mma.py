"""Decode-sized linears on dense weights on the tensor cores (Gluon, mma.sync): bf16/fp16 weights (the bf16 weight
mode), and fp32 weights with bf16 rows (the head) with true fp32 products.

An fp32 weight is exactly the sum of three bf16 values (hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid): 8
significant bits each, for every weight of magnitude in [2^-100, 2^127)), and a bf16 times a bf16 is exact in fp32. So
with bf16 activations, x . w = x . hi + x . mid + x . lo is the true fp32-product dot, summed in fp32 by three MMAs
(m16n8k16) per 32 columns into one accumulator: the reference's math (in float64 the pieces sum to w), fp32 rounding
aside. That rounding is the tensor cores', not an FMA chain's: measured on an H100 the head's output (K 5120 in one
accumulator) is 1.7e-5 from the float64 product relative to its norm, against under 1e-6 where the split of K keeps each
accumulator short (384 x 5120; 100 x 96). A bf16/fp16 weight is its own single piece. The weights are the MMA's wide
operand: lane t reads columns 8t to 8t + 7 of each 32-column group and the activations are read at the same columns (any
k order serves a dot without scales), 8, 16 or 32 rows per program; a second weight of the same K (a pair on one input)
takes the tiles past the first's. A row's result is the same at every row count (each MMA output is its own row's dot;
the split of K follows from the weights), so batch invariant. Launched like the Triton kernels, PDL included.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .mma_common import A_OPERAND, B_OPERAND, MMA, activations_layout, linear_plan, store_split, wait_for_inputs
from .workspace import split_buffers
from .launch import launch_options

GROUP = 32  # columns per loop step
_GROUP = gl.constexpr(GROUP)


@gluon.jit
def _as_operand(piece, BN: gl.constexpr):
    """A lane's 8 values [BN, 4 t, 8 i] of a 32-column group -> the A operand [BN, 32], value i of lane t at
    k = (i & 1) + 2t + 8 (i >> 1 & 1) + 16 (i >> 2), where the m16n8k16 fragment holds it."""
    return gl.convert_layout(gl.reshape(gl.permute(gl.reshape(piece, [BN, 4, 2, 2, 2]), [0, 2, 3, 1, 4]),
                                        [BN, 32]), A_OPERAND)


@gluon.jit
def _dense_mma_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits, stride_xm, stride_wn,
                      w2_ptr, out2_ptr, N2, tiles1, BN: gl.constexpr, BM: gl.constexpr, PIECES: gl.constexpr):
    """out[m, n] = sum over k of x[m, k] w[n, k] for this program's BN weight rows, BM rows and split of K (fp32
    weights as PIECES = 3 bf16 pieces, bf16/fp16 ones as they are); the last program of a (tile, row block) sums
    the splits' partials in split order. Tiles past `tiles1` take a second weight w2 [N2, K] into out2."""
    wait_for_inputs()
    # [128 rows, 4 t, 8 i]: lane 4 (row % 8) + t holds rows r and r + 8 of its warp's 16-row tile (and + 64), its
    # 8 adjacent columns of the group
    WEIGHTS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0], [64, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[128, 4, 8])
    XL: gl.constexpr = activations_layout(BM)  # [BM, 4 t, 4 groups, 8 i]; one group is read per step
    gl.static_assert(BN == 128, "the weights' layout is written for 128 weight rows per program")
    tile = gl.program_id(0)
    part_ptr += (tile >= tiles1).to(gl.int64) * splits * M * N  # the second weight's partials after the first's
    if tile >= tiles1:
        w_ptr, out_ptr, N = w2_ptr, out2_ptr, N2
        tile -= tiles1
    n0 = tile * BN
    pid_s = gl.program_id(1)
    row0 = gl.program_id(2) * BM
    k_start = pid_s * k_chunk
    k_stop = gl.minimum(k_start + k_chunk, K)
    n_w = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WEIGHTS))), N - 1)
    t_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WEIGHTS)))
    i_w = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, WEIGHTS)))
    w_rows = w_ptr + n_w[:, None, None].to(gl.int64) * stride_wn + 8 * t_w[None, :, None] + i_w[None, None, :]
    XG: gl.constexpr = gl.SliceLayout(2, XL)  # one group of the activations' layout: [BM, 4 t, 8 i]
    r_x = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, XG)))
    t_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XG)))
    i_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, XG)))
    x_rows = x_ptr + r_x[:, None, None].to(gl.int64) * stride_xm + 8 * t_x[None, :, None] + i_x[None, None, :]
    x_ok = (r_x < M)[:, None, None] & (i_x >= 0)[None, None, :]
    n_c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    r_c = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    for k in range(k_start, k_stop, _GROUP):
        w = gl.load(w_rows + k)  # [BN, 4, 8]
        xq = gl.load(x_rows + k, mask=x_ok, other=0.0)  # [BM, 4, 8]
        # [m, t, c, b, a] (i = 4c + 2b + a: k = 16c + 8b + 2t + a) -> [c, b, t, a, m] = [k, m]
        xg = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(xq, [BM, 4, 2, 2, 2]), [2, 3, 1, 4, 0]),
                                          [32, BM]), B_OPERAND)
        if PIECES == 3:
            hi = w.to(gl.bfloat16)
            rest = w - hi.to(gl.float32)  # exact: w and hi agree in their leading bits
            mid = rest.to(gl.bfloat16)
            lo = (rest - mid.to(gl.float32)).to(gl.bfloat16)  # exact: what is left has at most 8 bits
            acc = mma_v2(_as_operand(hi, BN), xg, acc)
            acc = mma_v2(_as_operand(mid, BN), xg, acc)
            acc = mma_v2(_as_operand(lo, BN), xg, acc)
        else:
            acc = mma_v2(_as_operand(w, BN), xg, acc)
    store_split(acc, out_ptr, part_ptr, count_ptr, r_c, n_c, M, N, pid_s, splits)


def dense_mma_applies(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_mma_linear takes these rows and weight: bf16 rows with an fp32 weight, or rows of the weight's
    dtype (bf16/fp16); contiguous, K a multiple of 32."""
    operand = torch.bfloat16 if weight.dtype == torch.float32 else weight.dtype
    return (rows.dtype == operand and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and rows.shape[1] == weight.shape[1] and rows.shape[1] % GROUP == 0 and rows.stride(-1) == 1
            and weight.is_contiguous())


def dense_mma_linear(rows: torch.Tensor, weight: torch.Tensor, second: torch.Tensor | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[M, N] = rows [M, K] @ weight [N, K]^T with exact products (fp32 out for an fp32 weight, else the weight's
    dtype); with `second` (a weight of the same K and dtype), both products from one launch. dense_mma_applies
    must hold. The split of K follows from the weights' shapes."""
    if not dense_mma_applies(rows, weight) or (second is not None and (
            second.dtype != weight.dtype or not dense_mma_applies(rows, second))):
        raise ValueError(f"the tensor-core dense linear takes bf16 rows with fp32 weights or rows of the weights' "
                         f"dtype, contiguous, K a multiple of {GROUP}; got {rows.dtype} rows, {weight.dtype} "
                         f"weights, K {weight.shape[1]}")
    m, k = rows.shape
    n = weight.shape[0]
    n2 = second.shape[0] if second is not None else 0
    tiles1, tiles, per, splits, bm = linear_plan(m, n, n2, k // GROUP)
    row_blocks = triton.cdiv(m, bm)
    out_dtype = torch.float32 if weight.dtype == torch.float32 else weight.dtype
    out = torch.empty(m, n, dtype=out_dtype, device=rows.device)
    out2 = torch.empty(m, n2, dtype=out_dtype, device=rows.device) if second is not None else out
    part, count = split_buffers(splits, (m, n + n2), tiles * row_blocks, rows.device)
    _dense_mma_kernel[(tiles, splits, row_blocks)](rows, weight, out, part, count, m, n, k, per * GROUP, splits,
                                                   rows.stride(0), weight.stride(0),
                                                   second if second is not None else weight, out2, n2, tiles1,
                                                   BN=128, BM=bm, PIECES=3 if weight.dtype == torch.float32 else 1,
                                                   num_warps=4, **launch_options())
    return (out, out2) if second is not None else out
