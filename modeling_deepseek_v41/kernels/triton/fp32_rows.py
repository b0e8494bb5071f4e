"""Decode-sized linears on fp32 weights (the head, the compressors' projections): true fp32 products on CUDA cores.

A plain tensor-core dot cannot multiply fp32 exactly (dense_mma.py does, for bf16 rows, with each weight split
into three bf16 pieces; off until timed), and Triton's fp32 dot on CUDA cores stages its operands through shared
memory for every padded token column: the 129,280 x 5,120 head took 6.1 ms at one row (11x its bytes). Here
each program streams a [BN, BK] weight tile once and multiplies it into BM token rows held in registers: every
weight feeds BM fused multiply-adds, nothing is staged. A row's products are summed in one fixed order (per lane
over K, then across the BK lanes, then the split partials in split order) whatever the call's row count, so a row's
result never depends on the other rows (batch invariant), and the float64 path of the interpreter is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import reduce_sum
from .splits import arrive_last, sum_partials
from .workspace import split_buffers
from .launch import launch_options, wait_for_inputs

ROWS_TILE = {"BN": 32, "BK": 64, "BM": 4, "num_warps": 4, "num_stages": 3}
# more than BM rows: 8 rows per program over 16 weight rows (the same BK, so the same sums: H200, the head at 6 rows
# 1,115 -> 981 us, at 32 rows 3,795 -> 3,222 us; at one row ROWS_TILE's 690 us against 969)
WIDE_ROWS_TILE = {"BN": 16, "BK": 64, "BM": 8, "num_warps": 4, "num_stages": 3}
SPLIT_TARGET_PROGRAMS = 528  # a few programs per SM at one row: the head has 4,040 tiles, a compressor 16
# the last program of a tile adds its partials four per L2 round trip: a narrow weight (a router gate over 32
# experts is one tile) split 80 ways waited 20 round trips (H200: ~9 us per gate launch for 0.65 MB; not yet timed
# with the cap)
MAX_SPLITS = 16


@triton.jit
def _fp32_rows_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits, stride_xm, stride_wn,
                      stride_om, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr):
    """out[m, n] = sum over k of x[m, k] w[n, k] for this program's BM rows, BN weight rows and split of K."""
    wait_for_inputs()
    pid_m = tl.program_id(0)  # the row blocks of one weight tile run side by side: the tile is read once from HBM
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, BK)
    n_ok = offs_n < N
    m_ok = rows < M
    k_start = pid_s * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, K)
    acc = tl.full([BM, BN, BK], 0.0, ACC)
    for k in range(k_start, k_stop, BK):
        k_ok = (k + cols) < k_stop
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + cols)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(ACC)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k + cols)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(ACC)
        acc += x[:, None, :] * w[None, :, :]
    total = reduce_sum(acc, 2)
    offs = rows[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if splits == 1:
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        split_stride = M * stride_om
        tl.store(part_ptr + pid_s * split_stride + offs, total, mask=mask)
        tile = pid_n * tl.num_programs(0) + pid_m
        if arrive_last(count_ptr, tile, splits):
            total = sum_partials(part_ptr, offs, mask, splits, split_stride)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def fp32_rows_linear(rows: torch.Tensor, weight: torch.Tensor, tile: dict | None = None,
                     split_target: int = SPLIT_TARGET_PROGRAMS) -> torch.Tensor:
    """rows [M, K] (any float dtype, taken as fp32) times a weight [N, K]^T of any float dtype, taken as fp32 (or
    both as float64 for a float64 weight) -> [M, N] in fp32 (float64), exactly: fp32 products and sums in a fixed
    order. The split of K depends on (N, K) alone. `tile`/`split_target` override the tiling (benchmarks only)."""
    m, k = rows.shape
    split_tile = tile or ROWS_TILE  # the split from ROWS_TILE's tiles whatever the row count: the same sums
    tile = tile or (ROWS_TILE if m <= ROWS_TILE["BM"] else WIDE_ROWS_TILE)
    n = weight.shape[0]
    k_blocks = triton.cdiv(k, tile["BK"])
    wanted = max(1, min(MAX_SPLITS, triton.cdiv(split_target, triton.cdiv(n, split_tile["BN"]))))
    per_split = triton.cdiv(k_blocks, min(k_blocks, wanted))
    splits, k_chunk = triton.cdiv(k_blocks, per_split), per_split * tile["BK"]
    out = torch.empty(m, n, dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32,
                      device=rows.device)
    grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(n, tile["BN"]), splits)
    part, count = split_buffers(splits, (m, n), grid[0] * grid[1], rows.device)
    if splits > 1 and weight.dtype == torch.float64:
        part = part.double()
    _fp32_rows_kernel[grid](rows, weight, out, part, count, m, n, k, k_chunk, splits, rows.stride(0),
                            weight.stride(0), out.stride(0), BN=tile["BN"], BK=tile["BK"], BM=tile["BM"],
                            ACC=tl.float64 if weight.dtype == torch.float64 else tl.float32,
                            num_warps=tile["num_warps"], num_stages=tile["num_stages"], **launch_options())
    return out
