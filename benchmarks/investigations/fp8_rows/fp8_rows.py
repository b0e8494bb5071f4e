"""Investigation, not wired into the model: the FP8 linears at decode rows on the CUDA cores with explicit layouts
(Gluon), linear_rows.py's products without its shared-memory round trips (`check.py` compiles and times it).

Triton gives the rows kernel's activation loads a layout of their own and its per-group sums another, so every row of
every slice passes twice through shared memory (offline sm_90: 6 barriers per slice at one row, 24 at six). Here one
layout W3 serves the whole product: the weight tile as [BN rows, G groups, 32 columns], a thread holding 16 adjacent
bytes of a group of each of its rows and its partner lane the other 16; a row's activations are loaded straight into
W3's slice along the rows (each thread the 16 values its bytes meet; the lanes that share them read them from L1);
a group's sum is the thread's 16 products then its partner's (one shuffle), in W3's slice along the columns, where
the E8M0 scales are loaded too and the accumulators live. Each row has its accumulator, summed in the same order at
any row count: batch invariant. Products of e4m3 values times powers of two are exact in fp32. One row arrives raw
and is QDQ'd here (common.qdq_groups' values: per row and 32-column group, a partner shuffle for the amax).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from modeling_deepseek_v41.kernels.triton.common import e8m0_byte_value, pow2_ceil_scale
from modeling_deepseek_v41.kernels.triton.launch import launch_options
from modeling_deepseek_v41.kernels.triton.linear_rows import SPLIT_TARGET_PROGRAMS, rows_split
from modeling_deepseek_v41.kernels.triton.mma_common import barrier, wait_for_inputs
from modeling_deepseek_v41.kernels.triton.quant import fp8_act_qdq
from modeling_deepseek_v41.kernels.triton.workspace import split_buffers

TILE = {"BN": 32, "BK": 256, "num_warps": 4}  # offline sm_90: no spill at 8 rows (BN 64: 255 registers and a stack)


@gluon.constexpr_function
def tile_layout(bn, bk, warps):
    """W3 for a [bn, bk / 32, 32] tile: 16 bytes per thread, two lanes per group, the groups across the remaining
    lanes, rows across the lanes left and the warps."""
    groups = int(bk) // 32
    return gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[32 // (2 * groups), groups, 2],
                            warps_per_cta=[int(warps), 1, 1], order=[2, 1, 0])


@gluon.jit
def _row_values(x_row, cols, ok, QDQ_X: gl.constexpr):
    """One row's activations of the slice [G, 32] as fp32 (W3's slice along the rows); QDQ_X: QDQ'd here."""
    x = gl.load(x_row + cols, mask=ok, other=0.0).to(gl.float32)
    if QDQ_X:
        scale = pow2_ceil_scale(gl.maximum(gl.max(gl.abs(x), axis=1), 1e-4))
        codes = gl.minimum(gl.maximum(x / gl.expand_dims(scale, 1), -448.0), 448.0).to(gl.float8e4nv)
        x = codes.to(gl.float32) * gl.expand_dims(scale, 1)
    return x


@gluon.jit
def _row_sums(acc, w, x, scale):
    """acc + the row's per-group dots with the tile [BN, G], each times its group's scale."""
    return acc + gl.sum(w * gl.expand_dims(x, 0), axis=2) * scale


@gluon.jit
def _store(acc, r, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits):
    """Row r's [BN] sums: the output (one split) or this split's partials."""
    total = gl.sum(acc, axis=1)
    if splits == 1:
        gl.store(out_ptr + r * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        gl.store(part_ptr + pid_s * split_stride + r * stride_pm + part_col + n, total, mask=n_ok)


@gluon.jit
def _fp8_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits,
                     stride_xm, stride_wn, stride_sn, stride_om, stride_pm,
                     w2_ptr, s2_ptr, out2_ptr, N2, tiles1, stride_o2m,
                     BN: gl.constexpr, BK: gl.constexpr, BM: gl.constexpr, PAIR: gl.constexpr,
                     QDQ_X: gl.constexpr, WARPS: gl.constexpr):
    """linear_rows._linear_rows_kernel for e4m3 weights with E8M0 32 x 32 tiles: out[m, g*N + n] = sum over k of
    x[m, g*K + k] w[g*N + n, k] for the BM rows, this program's BN weight rows and split of K (the group g and split
    from the grid's second axis); PAIR: tiles past `tiles1` take w2 [N2, K] into out2."""
    wait_for_inputs()
    W3: gl.constexpr = tile_layout(BN, BK, WARPS)
    G: gl.constexpr = BK // 32
    ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, W3))
    pid_n = gl.program_id(0)
    g = gl.program_id(1) // splits
    pid_s = gl.program_id(1) % splits
    tile = g * gl.num_programs(0) + pid_n
    part_col = g * N
    out_col = g * N
    if PAIR:
        if pid_n >= tiles1:
            w_ptr, s_ptr, out_ptr, stride_om = w2_ptr, s2_ptr, out2_ptr, stride_o2m
            part_col, out_col, pid_n, N = N, 0, pid_n - tiles1, N2
    n = pid_n * BN + gl.arange(0, BN, layout=ROWS)
    n_ok = n < N
    rows_n = g * N + gl.minimum(n, N - 1)  # rows past N repeat the last (not stored): loads need no row mask
    x_ptr += g * K
    k_start = pid_s * k_chunk
    k_stop = gl.minimum(k_start + k_chunk, K)
    # [BN, G, 32] byte offsets of the tile at column 0, and [G, 32] columns of a row's slice
    r3 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3)))
    g3 = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
    i3 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
    rows3 = g * N + gl.minimum(pid_n * BN + r3, N - 1)
    w_offs = (gl.expand_dims(gl.expand_dims(rows3.to(gl.int64) * stride_wn, 1), 2)
              + gl.expand_dims(gl.expand_dims(32 * g3, 0), 2) + gl.expand_dims(gl.expand_dims(i3, 0), 1))
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(0, W3)))
    ix = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(0, W3)))
    x_cols = gl.expand_dims(32 * gx, 1) + gl.expand_dims(ix, 0)
    s_rows = gl.expand_dims((rows_n // 32).to(gl.int64) * stride_sn, 1)
    acc0 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc1 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc2 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc3 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc4 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc5 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc6 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    acc7 = gl.zeros([BN, G], gl.float32, gl.SliceLayout(2, W3))
    for k in range(k_start, k_stop, BK):
        cols = k + x_cols
        ok = cols < k_stop
        w_ok = gl.expand_dims(ok, 0) & gl.expand_dims(gl.expand_dims(r3 >= 0, 1), 2)
        w = gl.load(w_ptr + w_offs + k, mask=w_ok, other=0.0).to(gl.float32)
        groups = k // 32 + g3
        # groups past K read no scale (1.0): past the row lies another row's scale, and 0 x inf = NaN
        byte = gl.load(s_ptr + s_rows + gl.expand_dims(groups, 0),
                       mask=gl.expand_dims(groups * 32 < k_stop, 0) & gl.expand_dims(rows_n >= 0, 1), other=127)
        scale = e8m0_byte_value(byte)
        acc0 = _row_sums(acc0, w, _row_values(x_ptr, cols, ok, QDQ_X), scale)
        if BM > 1:
            acc1 = _row_sums(acc1, w, _row_values(x_ptr + stride_xm, cols, ok, QDQ_X), scale)
        if BM > 2:
            acc2 = _row_sums(acc2, w, _row_values(x_ptr + 2 * stride_xm, cols, ok, QDQ_X), scale)
        if BM > 3:
            acc3 = _row_sums(acc3, w, _row_values(x_ptr + 3 * stride_xm, cols, ok, QDQ_X), scale)
        if BM > 4:
            acc4 = _row_sums(acc4, w, _row_values(x_ptr + 4 * stride_xm, cols, ok, QDQ_X), scale)
        if BM > 5:
            acc5 = _row_sums(acc5, w, _row_values(x_ptr + 5 * stride_xm, cols, ok, QDQ_X), scale)
        if BM > 6:
            acc6 = _row_sums(acc6, w, _row_values(x_ptr + 6 * stride_xm, cols, ok, QDQ_X), scale)
        if BM > 7:
            acc7 = _row_sums(acc7, w, _row_values(x_ptr + 7 * stride_xm, cols, ok, QDQ_X), scale)
    out_ptr += out_col
    split_stride = M * stride_pm
    _store(acc0, 0, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 1:
        _store(acc1, 1, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 2:
        _store(acc2, 2, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 3:
        _store(acc3, 3, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 4:
        _store(acc4, 4, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 5:
        _store(acc5, 5, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 6:
        _store(acc6, 6, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if BM > 7:
        _store(acc7, 7, n, n_ok, out_ptr, stride_om, part_ptr, stride_pm, part_col, pid_s, split_stride, splits)
    if splits > 1:  # the last program of the tile sums the partials in split order (splits.arrive_last's scheme)
        barrier()
        ticket = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            for r in range(0, M):
                offs = r * stride_pm + part_col + n
                total = gl.load(part_ptr + offs, mask=n_ok, other=0.0, cache_modifier=".cg")
                for s in range(1, splits):
                    total += gl.load(part_ptr + s * split_stride + offs, mask=n_ok, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + r * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def gluon_rows_linear(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, n: int, k: int,
                      out_dtype: torch.dtype, groups: int = 1, second: tuple | None = None, quantize: bool = False,
                      tile: dict | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """linear_rows.rows_linear for e4m3 weights through _fp8_rows_kernel: the same grid, split and partials. More
    rows than one are QDQ'd by a launch first, into fp32 (offline sm_90 at six rows, BN 32: 12.1 instructions per
    weight byte against 13.5 for bf16 rows, whose every lane converts the values it shares)."""
    tile = tile or TILE
    m = x2d.shape[0]
    if quantize and m > 1:
        x2d, quantize = fp8_act_qdq(x2d, torch.float32), False
    w2, s2, n2 = second if second is not None else (weight, scale, 0)
    columns = groups * n + n2
    splits, k_chunk = rows_split(columns, k, tile, SPLIT_TARGET_PROGRAMS)
    out = torch.empty(m, groups * n, dtype=out_dtype, device=x2d.device)
    out2 = torch.empty(m, n2, dtype=out_dtype, device=x2d.device) if second is not None else out
    tiles1 = triton.cdiv(n, tile["BN"])
    grid = (tiles1 + triton.cdiv(n2, tile["BN"]), groups * splits)
    part, count = split_buffers(splits, (m, columns), grid[0] * groups, x2d.device)
    s_arg, s2_arg = scale.view(torch.uint8), s2.view(torch.uint8)
    _fp8_rows_kernel[grid](x2d, weight, s_arg, out, part, count, m, n, k, k_chunk, splits, x2d.stride(0),
                           weight.stride(0), s_arg.stride(0), out.stride(0), columns, w2, s2_arg, out2, n2, tiles1,
                           out2.stride(0), BN=tile["BN"], BK=tile["BK"], BM=m, PAIR=second is not None,
                           QDQ_X=quantize, WARPS=tile["num_warps"], num_warps=tile["num_warps"], **launch_options())
    return (out, out2) if second is not None else out
