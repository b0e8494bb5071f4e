"""The grouped MoE's decode formulation for packed FP4 experts: one activation row at a time on the CUDA cores.

At decode sizes an expert sees a row or a few, so a tensor-core tile wastes most of its rows, and the tiles' operand
shuffles cost ~15 instructions per weight byte (moe.py). Here each thread keeps its own 16-byte runs of the packed
weight (one 32-column scale group of one weight row), turns each int32 word into its eight values with a few
integer operations and the hardware's e4m3x2 -> f16x2 conversion (common.fp4_word_nibbles), and multiplies them by
the row's activations in fp32 FMAs. The activations arrive QDQ'd in fp32, their columns in nibble-major order
(x[i * K/8 + w] is column 8w + i), so the values of nibble i of a thread's words meet theirs in one vector load, with
no shuffle. Products of e2m1 and e4m3 values times powers of two are exact in fp32: the emulation's numbers up to
fp32 summation order, which is fixed per row (each row is summed alone, in the same order whatever the call's rows):
batch invariant. Blocks, splits and the SwiGLU epilogue are moe.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, e8m0_byte_value, fp4_word_nibbles, reduce_sum
from .fp4_dot import slice_width
from .linear import _TL_DTYPES
from .moe_swiglu import swiglu_store
from .quant import fp8_act_qdq
from .splits import arrive_last, sum_partials
from .workspace import split_buffers
from .launch import launch_options, wait_for_inputs

# the fastest of a sweep on the H200 (num_stages > 1, Triton's cp.async pipeline of the slices, not yet measured)
ROWS_TILE = {"BN": 64, "BK": 128, "BM": 16, "num_warps": 4, "num_stages": 1, "prefetch": False}
# K columns per split, constants so the split count depends on the shapes only (fills the GPU at one token)
ROWS_K_CHUNK = {"up": 1280, "down": 1152}
# rows two at a time (each weight slice unpacked once for both; more registers) from this many expected rows per
# chosen expert: offline sm_90 SASS, 748 instructions per slice for a pair against 530 per row alone
PAIR_ROWS = 1.25


def rows_per_expert(tokens: int, top_k: int, n_experts: int) -> float:
    """The expected rows per chosen expert of `tokens` tokens routed uniformly to top_k of n_experts."""
    pairs = tokens * top_k
    return pairs / (n_experts * (1.0 - (1.0 - 1.0 / n_experts) ** pairs)) if pairs else 0.0


@triton.jit
def _slice_words(w_ptr, s_ptr, words, scales, k):
    """The packed words [BN, BK/8] and E8M0 scale bytes [BN, BK/32] of the BK-column slice at column k."""
    kw = tl.multiple_of(k // 8, 4)  # slices start at multiples of 32 columns: 16-byte loads
    return tl.load(w_ptr + kw + words), tl.load(s_ptr + k // 32 + scales)


@triton.jit
def _slice_values(word, byte, IEEE: tl.constexpr):
    """One slice's weights as fp32: the 8 nibbles of its words [BN, BK/8] (values x 2^-6, fp4_word_nibbles) and the
    32-column groups' scales [BN, BK/32] (times 2^6, undoing it)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = fp4_word_nibbles(word, IEEE)
    return (v0.to(tl.float32), v1.to(tl.float32), v2.to(tl.float32), v3.to(tl.float32), v4.to(tl.float32),
            v5.to(tl.float32), v6.to(tl.float32), v7.to(tl.float32), 64.0 * e8m0_byte_value(byte))


@triton.jit
def _slice_dot(v0, v1, v2, v3, v4, v5, v6, v7, scale, x, k, KW):
    """[BN, BK/32] partial sums of one slice (_slice_values) with one row's nibble-major activations (x: the slice's
    word offsets [BK/8], loaded once per nibble and broadcast over the weight rows a thread holds), each 32-column
    group times its scale."""
    xk = x + tl.multiple_of(k // 8, 4)
    part = v0 * tl.load(xk)[None, :]
    part += v1 * tl.load(xk + KW)[None, :]
    part += v2 * tl.load(xk + 2 * KW)[None, :]
    part += v3 * tl.load(xk + 3 * KW)[None, :]
    part += v4 * tl.load(xk + 4 * KW)[None, :]
    part += v5 * tl.load(xk + 5 * KW)[None, :]
    part += v6 * tl.load(xk + 6 * KW)[None, :]
    part += v7 * tl.load(xk + 7 * KW)[None, :]
    group = reduce_sum(tl.reshape(part, [v0.shape[0], v0.shape[1] // 4, 4]), 2)
    return group * scale


@triton.jit
def _row_dots(w_ptr, s_ptr, w2_ptr, s2_ptr, x_row, x_next, has_next, rows_n, k_start, k_stop, KW, stride_wn,
              stride_sn, BN: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, PAIRS: tl.constexpr,
              STAGES: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr):
    """[BN] dots of weight rows rows_n with the activation row x_row and (PAIRS, when has_next) the row x_next,
    over columns k_start..k_stop (whole BK slices): each slice unpacked once for both, each row summed alone in the
    same order as by itself. TWO: also the second weight's (the up projection's w1 and w3 in one pass). Returns
    (first, second) weight's dots of x_row, then of x_next. STAGES > 1: Triton's software pipeline copies the
    slices STAGES - 1 ahead into shared memory (cp.async; 6-8x slower on the H200). PREFETCH: the next slice's
    loads are issued before this slice's arithmetic, into registers, so a warp's loads wait while it computes (the
    last slice loads itself again, from cache, rather than past the split)."""
    G: tl.constexpr = BK // 32
    KW = tl.multiple_of(KW, 4)  # K is a multiple of 32
    w = tl.arange(0, BK // 8)
    words = rows_n[:, None] * stride_wn + w[None, :]
    x, x2 = x_row + w, x_next + w
    scales = rows_n[:, None] * stride_sn + tl.arange(0, G)[None, :]
    acc = tl.full([BN, G], 0.0, tl.float32)
    acc2 = tl.full([BN, G], 0.0, tl.float32)
    nxt = tl.full([BN, G], 0.0, tl.float32)
    nxt2 = tl.full([BN, G], 0.0, tl.float32)
    if PREFETCH:
        word, byte = _slice_words(w_ptr, s_ptr, words, scales, k_start)
        word2, byte2 = word, byte
        if TWO:
            word2, byte2 = _slice_words(w2_ptr, s2_ptr, words, scales, k_start)
    for k in tl.range(k_start, k_stop, BK, num_stages=STAGES):
        if PREFETCH:
            k_next = tl.minimum(k + BK, k_stop - BK)
            word_next, byte_next = _slice_words(w_ptr, s_ptr, words, scales, k_next)
            word2_next, byte2_next = word_next, byte_next
            if TWO:
                word2_next, byte2_next = _slice_words(w2_ptr, s2_ptr, words, scales, k_next)
        else:
            word, byte = _slice_words(w_ptr, s_ptr, words, scales, k)
            word2, byte2 = word, byte
            if TWO:
                word2, byte2 = _slice_words(w2_ptr, s2_ptr, words, scales, k)
        v0, v1, v2, v3, v4, v5, v6, v7, scale = _slice_values(word, byte, IEEE)
        acc += _slice_dot(v0, v1, v2, v3, v4, v5, v6, v7, scale, x, k, KW)
        if PAIRS:
            if has_next:
                nxt += _slice_dot(v0, v1, v2, v3, v4, v5, v6, v7, scale, x2, k, KW)
        if TWO:
            v0, v1, v2, v3, v4, v5, v6, v7, scale = _slice_values(word2, byte2, IEEE)
            acc2 += _slice_dot(v0, v1, v2, v3, v4, v5, v6, v7, scale, x, k, KW)
            if PAIRS:
                if has_next:
                    nxt2 += _slice_dot(v0, v1, v2, v3, v4, v5, v6, v7, scale, x2, k, KW)
        if PREFETCH:
            word, byte, word2, byte2 = word_next, byte_next, word2_next, byte2_next
    first, first_next = reduce_sum(acc, 1), reduce_sum(nxt, 1)
    second, second_next = first, first_next
    if TWO:
        second, second_next = reduce_sum(acc2, 1), reduce_sum(nxt2, 1)
    return first, second, first_next, second_next


@triton.jit
def _row_swiglu(gate, up, r, pair, route_ptr, h_ptr, offs_n, N, limit, stride_hm, BN: tl.constexpr,
                ROUND_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The SwiGLU epilogue of one row, h stored QDQ'd in fp32 in nibble-major order (the down projection's x)."""
    zero = tl.full([1], 0, tl.int32)
    h_cols = (offs_n % 8) * (N // 8) + offs_n // 8
    swiglu_store(gate[:, None], up[:, None], route_ptr, h_ptr, h_ptr, r + zero, zero == 0, pair + zero, offs_n, h_cols,
                 N, limit, stride_hm, 0, BN, 1, ROUND_DTYPE, H_DTYPE, HAS_LIMIT, True, False, False)


@triton.jit
def _up_result(gate, up, r, pair, splits, part, P, route_ptr, h_ptr, offs_n, N, limit, stride_hm, BN: tl.constexpr,
               ROUND_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Sorted row r's gate and up sums: its SwiGLU (one split), or this split's partials at `part`."""
    if splits == 1:
        _row_swiglu(gate, up, r, pair, route_ptr, h_ptr, offs_n, N, limit, stride_hm, BN, ROUND_DTYPE, H_DTYPE,
                    HAS_LIMIT)
    else:
        tl.store(part + r * N + offs_n, gate, mask=offs_n < N)
        tl.store(part + P * N + r * N + offs_n, up, mask=offs_n < N)


@triton.jit
def _moe_rows_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, route_ptr, pair_ptr, block_expert_ptr,
                        block_start_ptr, block_end_ptr, part_ptr, count_ptr, P, N, K, k_chunk, splits, top_k, limit,
                        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                        BN: tl.constexpr, BK: tl.constexpr, ROUND_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, PAIRS: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
                        PREFETCH: tl.constexpr):
    """h for the rows of one block of one expert, BN columns, one split of K: w1 and w3 in one pass per row; with
    splits, the last program of the tile sums the partials and applies the SwiGLU."""
    wait_for_inputs()
    b = tl.program_id(0)
    start = tl.load(block_start_ptr + b)
    end = tl.load(block_end_ptr + b)
    if start < end:  # blocks past the real count do nothing
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        w1, s1 = w1_ptr + expert * stride_we, s1_ptr + expert * stride_se
        w3, s3 = w3_ptr + expert * stride_we, s3_ptr + expert * stride_se
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        rows_n = tl.minimum(offs_n, N - 1)  # columns past N repeat the last (not stored): loads need no mask
        k_start = tl.program_id(2) * k_chunk
        k_stop = tl.minimum(k_start + k_chunk, K)
        split_stride = 2 * P * N  # per split: the gate partials, then the up partials
        for r in range(start, end, 1 + PAIRS):  # PAIRS: rows two at a time, each weight slice unpacked once
            has_next = r + 1 < end
            pair = tl.load(pair_ptr + r)
            pair_next = tl.load(pair_ptr + tl.minimum(r + 1, end - 1))
            gate, up, gate_next, up_next = _row_dots(
                w1, s1, w3, s3, x_ptr + (pair // top_k).to(tl.int64) * stride_xm,
                x_ptr + (pair_next // top_k).to(tl.int64) * stride_xm, has_next, rows_n, k_start, k_stop, K // 8,
                stride_wn, stride_sn, BN, BK, True, PAIRS, STAGES, IEEE, PREFETCH)
            _up_result(gate, up, r, pair, splits, part_ptr + tl.program_id(2) * split_stride, P, route_ptr, h_ptr,
                       offs_n, N, limit, stride_hm, BN, ROUND_DTYPE, H_DTYPE, HAS_LIMIT)
            if PAIRS and has_next:
                _up_result(gate_next, up_next, r + 1, pair_next, splits, part_ptr + tl.program_id(2) * split_stride,
                           P, route_ptr, h_ptr, offs_n, N, limit, stride_hm, BN, ROUND_DTYPE, H_DTYPE, HAS_LIMIT)
        if splits > 1:
            if arrive_last(count_ptr, b * tl.num_programs(1) + tl.program_id(1), splits):
                for r in range(start, end):
                    gate = sum_partials(part_ptr, r * N + offs_n, offs_n < N, splits, split_stride)
                    up = sum_partials(part_ptr + P * N, r * N + offs_n, offs_n < N, splits, split_stride)
                    _row_swiglu(gate, up, r, tl.load(pair_ptr + r), route_ptr, h_ptr, offs_n, N, limit, stride_hm,
                                BN, ROUND_DTYPE, H_DTYPE, HAS_LIMIT)


@triton.jit
def _down_result(acc, r, splits, pair_ptr, c_ptr, part, offs_n, N, stride_cm, ROUND_DTYPE: tl.constexpr):
    """Sorted row r's sums: its contribution rounded to the activation dtype (one split), or this split's partials
    at `part`."""
    if splits == 1:
        tl.store(c_ptr + tl.load(pair_ptr + r).to(tl.int64) * stride_cm + offs_n,
                 cast(cast(acc, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        tl.store(part + r * N + offs_n, acc, mask=offs_n < N)


@triton.jit
def _moe_rows_down_kernel(h_ptr, w2_ptr, s2_ptr, c_ptr, pair_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                          part_ptr, count_ptr, P, N, K, k_chunk, splits, stride_hm, stride_we, stride_wn, stride_se,
                          stride_sn, stride_cm, BN: tl.constexpr, BK: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                          PAIRS: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr):
    """contribution[pair, n] = h[sorted row] @ w2[expert]^T rounded to the activation dtype, row by row (one split
    of K per program; with splits, the last program of the tile sums the partials)."""
    wait_for_inputs()
    b = tl.program_id(0)
    start = tl.load(block_start_ptr + b)
    end = tl.load(block_end_ptr + b)
    if start < end:
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        w2, s2 = w2_ptr + expert * stride_we, s2_ptr + expert * stride_se
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        rows_n = tl.minimum(offs_n, N - 1)
        k_start = tl.program_id(2) * k_chunk
        k_stop = tl.minimum(k_start + k_chunk, K)
        for r in range(start, end, 1 + PAIRS):  # PAIRS: rows two at a time, each weight slice unpacked once
            has_next = r + 1 < end
            acc, _, acc_next, _ = _row_dots(w2, s2, w2, s2, h_ptr + r * stride_hm,
                                            h_ptr + tl.minimum(r + 1, end - 1) * stride_hm, has_next, rows_n,
                                            k_start, k_stop, K // 8, stride_wn, stride_sn, BN, BK, False, PAIRS,
                                            STAGES, IEEE, PREFETCH)
            _down_result(acc, r, splits, pair_ptr, c_ptr, part_ptr + tl.program_id(2) * P * N, offs_n, N, stride_cm,
                         ROUND_DTYPE)
            if PAIRS and has_next:
                _down_result(acc_next, r + 1, splits, pair_ptr, c_ptr, part_ptr + tl.program_id(2) * P * N, offs_n,
                             N, stride_cm, ROUND_DTYPE)
        if splits > 1:
            if arrive_last(count_ptr, b * tl.num_programs(1) + tl.program_id(1), splits):
                for r in range(start, end):
                    acc = sum_partials(part_ptr, r * N + offs_n, offs_n < N, splits, P * N)
                    tl.store(c_ptr + tl.load(pair_ptr + r).to(tl.int64) * stride_cm + offs_n,
                             cast(cast(acc, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty), mask=offs_n < N)


def _launch(blocks: int, n: int, k: int, chunk: int, bn: int, bk: int, partial_rows: int, device: torch.device):
    """(grid, partials, counts, K columns per split, splits, slice width) of one projection."""
    bk = slice_width(k, bk)
    k_chunk = triton.cdiv(min(chunk, k), bk) * bk
    splits = triton.cdiv(k, k_chunk)
    grid = (blocks, triton.cdiv(n, bn), splits)
    part, count = split_buffers(splits, (partial_rows, n), blocks * grid[1], device)
    return grid, part, count, k_chunk, splits, bk


def rows_moe(tokens: torch.Tensor, route: torch.Tensor, schedule: tuple, w1: torch.Tensor, s1: torch.Tensor,
             w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, top_k: int,
             ieee: bool, tile: dict | None = None, k_chunks: dict | None = None) -> torch.Tensor:
    """The contributions [pairs, D] (activation dtype) of every (token, expert) pair, for moe.grouped_moe.

    tokens [T, D]; route [T*k] fp32 routing weights; schedule moe_schedule's (pair_of_row, block_expert,
    block_start, block_end) for tile["BM"]-row blocks; w1, w3 [E, I, D/2] and w2 [E, D, I/2] packed FP4 with E8M0
    scales [E, N, K/32]."""
    tile, chunks = tile or ROWS_TILE, k_chunks or ROWS_K_CHUNK
    pair_of_row, block_expert, block_start, block_end = schedule
    t, d = tokens.shape
    inter, pairs, nb = w1.shape[1], t * top_k, block_expert.shape[0]
    act_dtype = tokens.dtype
    x = fp8_act_qdq(tokens, torch.float32, nibble_major=True)
    h = torch.empty(pairs, inter, dtype=torch.float32, device=tokens.device)
    w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))
    s1, s3, s2 = (s.view(torch.uint8) for s in (s1, s3, s2))
    # pairs where the blocks hold several rows (a row's sums are the same either way: batch invariant)
    launch = dict(launch_options(), num_warps=tile["num_warps"], IEEE=ieee, BN=tile["BN"],
                  STAGES=tile.get("num_stages", 1), PREFETCH=tile.get("prefetch", False),
                  PAIRS=rows_per_expert(t, top_k, w1.shape[0]) >= PAIR_ROWS)
    rounding = dict(ROUND_DTYPE=_TL_DTYPES[act_dtype])
    grid, part, count, k_chunk, splits, bk = _launch(nb, inter, d, chunks["up"], tile["BN"], tile["BK"], 2 * pairs,
                                                     tokens.device)
    _moe_rows_up_kernel[grid](x, w1, s1, w3, s3, h, route, pair_of_row, block_expert, block_start, block_end, part,
                              count, pairs, inter, d, k_chunk, splits, top_k, float(limit), x.stride(0), w1.stride(0),
                              w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), BK=bk,
                              H_DTYPE=_TL_DTYPES[act_dtype], HAS_LIMIT=limit > 0, **rounding, **launch)
    contributions = torch.empty(pairs, d, dtype=act_dtype, device=tokens.device)
    grid, part, count, k_chunk, splits, bk = _launch(nb, d, inter, chunks["down"], tile["BN"], tile["BK"], pairs,
                                                     tokens.device)
    _moe_rows_down_kernel[grid](h, w2, s2, contributions, pair_of_row, block_expert, block_start, block_end, part,
                                count, pairs, d, inter, k_chunk, splits, h.stride(0), w2.stride(0), w2.stride(1),
                                s2.stride(0), s2.stride(1), contributions.stride(0), BK=bk, **rounding, **launch)
    return contributions
