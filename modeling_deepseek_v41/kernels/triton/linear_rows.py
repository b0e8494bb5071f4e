"""Linears at the row counts of a decode step (up to ROWS_MAX_ROWS rows): the weight streamed once through the CUDA
cores, every loaded tile multiplied into each row in fp32 FMAs.

At one to eight rows a tensor-core tile pads the rows to 16 or 32 and stages both operands through shared memory;
here each program loads a [BN, BK] tile of the stored weight (e4m3 with E8M0 tiles of 32 x 32, or bf16/fp16/fp32)
into registers once and multiplies it by every row, whose activations are exactly QDQ'd (a single row's inside the
kernel, more rows' by a launch first; or rounded to the weight's dtype for dense weights): e4m3 x e4m3 or bf16 x
bf16 products are exact in fp32. Each row keeps its own
accumulator of the same shape, so its sum is one fixed order (in a thread over each 32-column group, across the
group's lanes, times the tile's power-of-two scale, over K, then the split partials in split order) whatever the
call's row count: batch invariant among calls of up to ROWS_MAX_ROWS rows (a DSpark verify equals its one-token
steps), and in float64 (the interpreter) the exact sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_TILE, cast, e8m0_byte_value, qdq_groups, reduce_sum
from .splits import arrive_last, pair_operands, sum_partials
from .workspace import split_buffers
from .launch import launch_options, wait_for_inputs
from .quant import fp8_act_qdq

ROWS_MAX_ROWS = 8
# kernel_tuning.py --only rows, H200 (prefetch: each next tile's loads issued ahead, not yet timed)
ROWS_TILE = {"BN": 64, "BK": 256, "num_warps": 4, "num_stages": 1, "prefetch": False}
SPLIT_TARGET_PROGRAMS = 528  # about four programs per SM; a constant, so the split depends on (N, K) only
_ROUNDED = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _row_part(w, scale, x_ptr, r, cols, k_ok, stride_xm, BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
              QDQ_X: tl.constexpr):
    """[BN, BK/32] sums of one row's products with the tile, per 32-column group, times the groups' scales. QDQ_X:
    the row arrives as it is and is QDQ'd here (the same values as quant.fp8_act_qdq's: slices start at multiples
    of 32 columns, so each group is whole)."""
    x = tl.load(x_ptr + r * stride_xm + cols, mask=k_ok, other=0.0).to(ACC)
    if QDQ_X:
        codes, x_scale = qdq_groups(x, BK)
        x = tl.reshape(codes * x_scale[:, None], [BK]).to(ACC)
    return reduce_sum(tl.reshape(w * x[None, :], [BN, BK // 32, 32]), 2) * scale


@triton.jit
def _tile_bytes(w_ptr, s_ptr, rows_n, k, k_stop, c, stride_wn, stride_sn, BK: tl.constexpr, WFMT: tl.constexpr):
    """The stored [BN, BK] weight tile at column k and, for FP8 tiles, its [BN, BK/32] E8M0 scale bytes (127, i.e.
    1.0, past K: past the row lies another row's scale, and 0 x inf = NaN), as loaded: masked past k_stop."""
    cols = k + c
    k_ok = cols < k_stop
    w = tl.load(w_ptr + rows_n[:, None] * stride_wn + cols[None, :], mask=k_ok[None, :], other=0.0)
    groups = k // 32 + tl.arange(0, BK // 32)
    byte = tl.full([rows_n.shape[0], BK // 32], 127, tl.uint8)
    if WFMT == FP8_TILE:
        byte = tl.load(s_ptr + (rows_n // 32)[:, None] * stride_sn + groups[None, :],
                       mask=(groups * 32 < k_stop)[None, :] & (rows_n >= 0)[:, None], other=127)
    return w, byte


@triton.jit
def _store_row(total, r, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col, stride_pm, pid_s,
               split_stride, splits):
    """Row r's [BN] sums: the output (one split) or this split's partials."""
    if splits == 1:
        tl.store(out_ptr + r * stride_om + out_col + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_s * split_stride + r * stride_pm + part_col + offs_n, total, mask=n_ok)


@triton.jit
def _finish_row(r, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col, stride_pm, split_stride, splits):
    """Row r's output from the split partials, summed in split order (the tile's last program)."""
    total = sum_partials(part_ptr, r * stride_pm + part_col + offs_n, n_ok, splits, split_stride)
    tl.store(out_ptr + r * stride_om + out_col + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _linear_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits,
                        stride_xm, stride_wn, stride_sn, stride_om, stride_pm,
                        w2_ptr, s2_ptr, out2_ptr, N2, tiles1, stride_o2m,
                        BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, WFMT: tl.constexpr,
                        PAIR: tl.constexpr, ACC: tl.constexpr, W_ROUND: tl.constexpr,
                        QDQ_X: tl.constexpr, PREFETCH: tl.constexpr):
    """out[m, g*N + n] = sum over k of x[m, g*K + k] w[g*N + n, k] for the M = BM rows, this program's BN weight
    rows and split of K; the group g (block-diagonal weights) and split come from the grid's second axis.
    PAIR: a second weight w2 [N2, K] of the same storage on the same input, its tiles after the first's `tiles1`;
    the partials [splits, M, N + N2] hold both. W_ROUND: a dtype the dense weight's values are rounded to first.
    PREFETCH: the next tile's loads are issued before this tile's arithmetic, so a warp's loads wait while it
    computes (masked off past the split)."""
    wait_for_inputs()
    pid_n = tl.program_id(0)
    g = tl.program_id(1) // splits
    pid_s = tl.program_id(1) % splits
    tile = g * tl.num_programs(0) + pid_n
    part_col = g * N
    out_col = g * N
    if PAIR:
        w_ptr, s_ptr, out_ptr, stride_om, part_col, pid_n, N = pair_operands(
            pid_n, tiles1, w_ptr, s_ptr, out_ptr, stride_om, N, w2_ptr, s2_ptr, out2_ptr, stride_o2m, N2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows_n = g * N + tl.minimum(offs_n, N - 1)  # rows past N repeat the last (not stored): loads need no row mask
    x_ptr += g * K
    k_start = pid_s * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, K)
    c = tl.arange(0, BK)
    G: tl.constexpr = BK // 32
    acc0 = tl.full([BN, G], 0.0, ACC)
    acc1 = tl.full([BN, G], 0.0, ACC)
    acc2 = tl.full([BN, G], 0.0, ACC)
    acc3 = tl.full([BN, G], 0.0, ACC)
    acc4 = tl.full([BN, G], 0.0, ACC)
    acc5 = tl.full([BN, G], 0.0, ACC)
    acc6 = tl.full([BN, G], 0.0, ACC)
    acc7 = tl.full([BN, G], 0.0, ACC)
    if PREFETCH:
        stored, byte = _tile_bytes(w_ptr, s_ptr, rows_n, k_start, k_stop, c, stride_wn, stride_sn, BK, WFMT)
    for k in range(k_start, k_stop, BK):
        cols = k + c
        k_ok = cols < k_stop
        if PREFETCH:
            stored_next, byte_next = _tile_bytes(w_ptr, s_ptr, rows_n, k + BK, k_stop, c, stride_wn, stride_sn, BK,
                                                 WFMT)
        else:
            stored, byte = _tile_bytes(w_ptr, s_ptr, rows_n, k, k_stop, c, stride_wn, stride_sn, BK, WFMT)
        w = stored.to(tl.float32).to(ACC)  # e4m3 -> fp32 exactly (the interpreter converts e4m3 to fp32 only)
        w = cast(w, W_ROUND).to(ACC)  # W_ROUND == ACC: no work
        scale = e8m0_byte_value(byte).to(ACC)
        acc0 += _row_part(w, scale, x_ptr, 0, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 1:
            acc1 += _row_part(w, scale, x_ptr, 1, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 2:
            acc2 += _row_part(w, scale, x_ptr, 2, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 3:
            acc3 += _row_part(w, scale, x_ptr, 3, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 4:
            acc4 += _row_part(w, scale, x_ptr, 4, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 5:
            acc5 += _row_part(w, scale, x_ptr, 5, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 6:
            acc6 += _row_part(w, scale, x_ptr, 6, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if BM > 7:
            acc7 += _row_part(w, scale, x_ptr, 7, cols, k_ok, stride_xm, BN, BK, ACC, QDQ_X)
        if PREFETCH:
            stored, byte = stored_next, byte_next
    split_stride = M * stride_pm
    _store_row(reduce_sum(acc0, 1), 0, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
               stride_pm, pid_s, split_stride, splits)
    if BM > 1:
        _store_row(reduce_sum(acc1, 1), 1, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 2:
        _store_row(reduce_sum(acc2, 1), 2, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 3:
        _store_row(reduce_sum(acc3, 1), 3, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 4:
        _store_row(reduce_sum(acc4, 1), 4, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 5:
        _store_row(reduce_sum(acc5, 1), 5, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 6:
        _store_row(reduce_sum(acc6, 1), 6, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if BM > 7:
        _store_row(reduce_sum(acc7, 1), 7, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col,
                   stride_pm, pid_s, split_stride, splits)
    if splits > 1:
        if arrive_last(count_ptr, tile, splits):
            for r in range(0, M):
                _finish_row(r, offs_n, n_ok, out_ptr, out_col, stride_om, part_ptr, part_col, stride_pm,
                            split_stride, splits)


def row_block(m: int) -> int:
    """The kernel's row count for m rows: m itself (one compiled kernel per count, so a 6-token verify pays for six
    rows of FMAs, not eight; each row's accumulator is the same whatever the count)."""
    if not 1 <= m <= ROWS_MAX_ROWS:
        raise ValueError(f"the rows formulation takes 1 to {ROWS_MAX_ROWS} rows, got {m}")
    return m


def rows_split(columns: int, k: int, tile: dict, target: int) -> tuple[int, int]:
    """(splits, K columns per split): enough programs to fill the GPU, from the weights' shape alone."""
    k_blocks = triton.cdiv(k, tile["BK"])
    wanted = max(1, triton.cdiv(target, triton.cdiv(columns, tile["BN"])))
    per_split = triton.cdiv(k_blocks, min(k_blocks, wanted))
    return triton.cdiv(k_blocks, per_split), per_split * tile["BK"]


def rows_linear(x2d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, fmt: int, n: int, k: int,
                out_dtype: torch.dtype, groups: int = 1, tile: dict | None = None, split_target: int | None = None,
                second: tuple[torch.Tensor, torch.Tensor | None, int] | None = None,
                weight_round: torch.dtype | None = None, quantize: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out [M, groups * n] = x2d [M, groups * k] times each group's n rows of the weight, for M <= ROWS_MAX_ROWS.

    x2d: the activations as the products take them (QDQ'd, or in the weight's dtype), contiguous along K; with
    `quantize`, as they are (bf16/fp16/fp32), to be FP8-QDQ'd first: inside the kernel for one row (no launch of
    its own), by quant.fp8_act_qdq for more (the kernel would repeat it per row); the same values either way.
    weight [groups * n, k] e4m3 with E8M0 tiles (fmt FMT_FP8_TILE) or dense (FMT_DENSE, scale None;
    `weight_round` bf16/fp16: its values rounded to that dtype first, in registers). second: (weight2, scale2, n2)
    of a second weight of the same storage on the same input (one group): returns (out, out2)."""
    m = x2d.shape[0]
    if quantize and (m > 1 or x2d.dtype == torch.float64):
        x2d, quantize = fp8_act_qdq(x2d, torch.bfloat16), False
    if tile is None:  # the same bytes per tile for wider dense weights (BK 256 of bf16 spills at eight rows)
        tile = dict(ROWS_TILE, BK=max(32, ROWS_TILE["BK"] // weight.element_size()))
    w2, s2, n2 = second if second is not None else (weight, scale, 0)
    columns = groups * n + n2
    splits, k_chunk = rows_split(columns, k, tile, split_target or SPLIT_TARGET_PROGRAMS)
    out = torch.empty(m, groups * n, dtype=out_dtype, device=x2d.device)
    out2 = torch.empty(m, n2, dtype=out_dtype, device=x2d.device) if second is not None else out
    tiles1 = triton.cdiv(n, tile["BN"])
    grid = (tiles1 + triton.cdiv(n2, tile["BN"]), groups * splits)
    part, count = split_buffers(splits, (m, columns), grid[0] * groups, x2d.device)
    wide = torch.float64 in (x2d.dtype, weight.dtype)
    acc = tl.float64 if wide else tl.float32
    if wide and splits > 1:
        part = part.double()
    s_arg = weight if scale is None else scale.view(torch.uint8)
    s2_arg = s_arg if s2 is None else s2.view(torch.uint8)
    _linear_rows_kernel[grid](
        x2d, weight, s_arg, out, part, count, m, n, k, k_chunk, splits,
        x2d.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0), out.stride(0), columns,
        w2, s2_arg, out2, n2, tiles1, out2.stride(0),
        BN=tile["BN"], BK=tile["BK"], BM=row_block(m), WFMT=fmt, PAIR=second is not None,
        ACC=acc, W_ROUND=_ROUNDED.get(weight_round, acc), QDQ_X=quantize,
        PREFETCH=tile.get("prefetch", False),
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **launch_options())
    return (out, out2) if second is not None else out
