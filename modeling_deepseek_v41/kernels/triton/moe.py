"""Grouped routed-expert MoE on the GPU: every (token, expert) pair of a step in three kernels, no host reads.

Pairs are sorted by expert on the device and cut into blocks of BM rows of one expert; the number of blocks
launched is a bound from the shapes (min(E, T*k) + ceil(T*k / BM)), so a step is capturable in a CUDA graph at any
batch size, and blocks past the real count exit at once. The numerics follow expert_ops.gathered_swiglu: gate and
up rounded to the activation dtype, clamped, h = route_weight * (silu(gate) * up) in fp32 and rounded to the
activation dtype, FP8 QDQ of h (quantized experts), w2 rounded to the activation dtype, then each token's k
contributions summed in fp32 in ascending expert order.

Three formulations of the up and down projections: tensor-core tiles of BM rows (here; dense and FP8 experts, and
packed FP4 ones where the next two do not apply), for packed FP4 experts at decode sizes one row at a time on the
CUDA cores (moe_rows.py), and for their prefills torch's grouped GEMM over bf16 copies (moe_grouped_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import FMT_DENSE, FMT_FP4_ROW, FMT_FP8_ROW, FP4_ROW, cast, dot_k_range, fp4_f16_dot_k_range
from .fp4_dot import fp4_scaled_dot, slice_width
from .linear import _TL_DTYPES, dot_dtype_for, launch_tile
from .moe_grouped_gemm import grouped_gemm_moe, grouped_gemm_pays
from .mma_choice import mma_moe_enabled
from .moe_mma import mma_block_rows, mma_moe
from .moe_rows import ROWS_TILE, rows_moe, rows_per_expert
from .moe_schedule import moe_schedule
from .moe_swiglu import swiglu_store
from .quant import fp8_act_qdq, fp8_act_quant
from .splits import arrive_last, sum_partials
from .workspace import split_buffers
from .launch import launch_options, wait_for_inputs

MOE_DECODE_MAX_TOKENS = 256
# the rows formulation (moe_rows) up to at least this many tokens: a batch-1 step, DSpark's verify and draft (one
# formulation for all, so they stay batch invariant)
MOE_ROWS_MAX_TOKENS = 8
# and further while the tokens' chosen experts (uniform routing) see at most this many rows each: the rows
# formulation reads an expert once per row, the tiles once per block of rows (H200, one layer of 384 experts, 32
# tokens: 1.3 rows each, rows 1,711 us against the tiles' 2,800; over 32 experts, 6 rows each, 1,447 against 648)
ROWS_PER_EXPERT = 2.0


@functools.lru_cache(maxsize=None)
def rows_token_limit(top_k: int, n_experts: int) -> int:
    """The largest token count the rows formulation takes for this routing (from the shapes alone, so one model
    always splits the regimes at the same count)."""
    limit = MOE_ROWS_MAX_TOKENS
    while limit < MOE_DECODE_MAX_TOKENS and rows_per_expert(limit + 1, top_k, n_experts) <= ROWS_PER_EXPERT:
        limit += 1
    return limit


MOE_DECODE_TILE = {"BN": 64, "BM": 16, "BK": 128, "num_warps": 4, "num_stages": 3}
MOE_PREFILL_TILE = {"BN": 128, "BM": 64, "BK": 64, "num_warps": 8, "num_stages": 3}
# K columns per split in the decode regime (a constant, so the split count depends on the shapes only): at one
# token a step has ~6 blocks, and without splitting each program would walk all of K alone
MOE_DECODE_K_CHUNK = {"up": 1280, "down": 1152}


@triton.jit
def _block_rows(block_start_ptr, block_end_ptr, pair_ptr, b, BM: tl.constexpr):
    start = tl.load(block_start_ptr + b)
    end = tl.load(block_end_ptr + b)
    sorted_rows = start + tl.arange(0, BM)
    mask = sorted_rows < end
    pair = tl.load(pair_ptr + sorted_rows, mask=mask, other=0)
    return start, end, sorted_rows, mask, pair


@triton.jit
def _expert_dot(w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, mask, k_start, k_stop, N, K, stride_wn, stride_sn,
                stride_xm, stride_xsm, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr,
                FP8_DOT: tl.constexpr, F16: tl.constexpr, X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                IEEE: tl.constexpr):
    """[BN, BM] = one expert's weight rows times the block's activations over one split of K (F16: packed FP4 in
    fp16 slices, see common.fp4_f16_dot_k_range; other packed FP4: fp4_dot.fp4_scaled_dot, the weights as int32
    words; otherwise common.dot_k_range)."""
    acc = tl.full([BN, BM], 0.0, tl.float32)
    if F16:
        acc = fp4_f16_dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, mask, k_start, k_stop, N, K,
                                  stride_wn, stride_sn, stride_xm, stride_xsm, BK, IEEE)
    elif WFMT == FP4_ROW and not FP8_DOT:  # rows past the block read row 0, weight rows past N the last
        acc = fp4_scaled_dot(acc, w_ptr, s_ptr, x_ptr, tl.minimum(offs_n, N - 1), tl.where(mask, rows, 0), k_start,
                             k_stop, stride_wn, stride_sn, stride_xm, BK, IEEE)
    else:
        acc = dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, mask, k_start, k_stop, N, K, stride_wn,
                          stride_sn, stride_xm, stride_xsm, BK, WFMT, FP8_DOT, X_DTYPE, DOT_DTYPE, IEEE)
    return acc


@triton.jit
def _moe_up_kernel(x_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, hs_ptr, route_ptr, pair_ptr,
                   block_expert_ptr, block_start_ptr, block_end_ptr, part_ptr, count_ptr, P, N, K, k_chunk, splits,
                   top_k, limit, stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                   stride_hsm,
                   BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr, FP8_DOT: tl.constexpr,
                   F16: tl.constexpr, X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                   H_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr, QDQ_OUT: tl.constexpr, IEEE: tl.constexpr):
    """h[sorted row, n] for one block of rows of one expert and one split of K: both projections from one read of
    the activations; with splits, the last program of the tile sums the partials and applies the SwiGLU."""
    wait_for_inputs()
    b = tl.program_id(0)
    start, end, sorted_rows, mask, pair = _block_rows(block_start_ptr, block_end_ptr, pair_ptr, b, BM)
    if start < end:  # blocks past the real count do nothing
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        tokens = pair // top_k
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        k_start = tl.program_id(2) * k_chunk
        k_stop = tl.minimum(k_start + k_chunk, K)
        gate = _expert_dot(w1_ptr + expert * stride_we, s1_ptr + expert * stride_se, x_ptr, xs_ptr, offs_n, tokens,
                           mask, k_start, k_stop, N, K, stride_wn, stride_sn, stride_xm, stride_xsm, BN, BM, BK, WFMT,
                           FP8_DOT, F16, X_DTYPE, DOT_DTYPE, IEEE)
        up = _expert_dot(w3_ptr + expert * stride_we, s3_ptr + expert * stride_se, x_ptr, xs_ptr, offs_n, tokens,
                         mask, k_start, k_stop, N, K, stride_wn, stride_sn, stride_xm, stride_xsm, BN, BM, BK, WFMT,
                         FP8_DOT, F16, X_DTYPE, DOT_DTYPE, IEEE)
        if splits == 1:
            swiglu_store(gate, up, route_ptr, h_ptr, hs_ptr, sorted_rows, mask, pair, offs_n, offs_n, N, limit,
                         stride_hm, stride_hsm, BN, BM, ROUND_DTYPE, H_DTYPE, HAS_LIMIT, QDQ_OUT, FP8_DOT, F16)
        else:
            offs = sorted_rows[None, :] * N + offs_n[:, None]
            tile_mask = mask[None, :] & (offs_n[:, None] < N)
            split_stride = 2 * P * N  # per split: the gate partials, then the up partials
            tl.store(part_ptr + tl.program_id(2) * split_stride + offs, gate, mask=tile_mask)
            tl.store(part_ptr + tl.program_id(2) * split_stride + P * N + offs, up, mask=tile_mask)
            if arrive_last(count_ptr, b * tl.num_programs(1) + tl.program_id(1), splits):
                gate = sum_partials(part_ptr, offs, tile_mask, splits, split_stride)
                up = sum_partials(part_ptr + P * N, offs, tile_mask, splits, split_stride)
                swiglu_store(gate, up, route_ptr, h_ptr, hs_ptr, sorted_rows, mask, pair, offs_n, offs_n, N, limit,
                             stride_hm, stride_hsm, BN, BM, ROUND_DTYPE, H_DTYPE, HAS_LIMIT, QDQ_OUT, FP8_DOT, F16)


@triton.jit
def _moe_down_kernel(h_ptr, hs_ptr, w2_ptr, s2_ptr, c_ptr, pair_ptr, block_expert_ptr, block_start_ptr,
                     block_end_ptr, part_ptr, count_ptr, P, N, K, k_chunk, splits, stride_hm, stride_hsm, stride_we,
                     stride_wn, stride_se, stride_sn, stride_cm,
                     BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr, FP8_DOT: tl.constexpr,
                     F16: tl.constexpr, X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, ROUND_DTYPE: tl.constexpr,
                     IEEE: tl.constexpr):
    """contribution[pair, n] = h[sorted row] @ w2[expert]^T, rounded to the activation dtype (one split of K per
    program; with splits, the last program of the tile sums the partials)."""
    wait_for_inputs()
    b = tl.program_id(0)
    start, end, sorted_rows, mask, pair = _block_rows(block_start_ptr, block_end_ptr, pair_ptr, b, BM)
    if start < end:  # blocks past the real count do nothing
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        k_start = tl.program_id(2) * k_chunk
        k_stop = tl.minimum(k_start + k_chunk, K)
        acc = _expert_dot(w2_ptr + expert * stride_we, s2_ptr + expert * stride_se, h_ptr, hs_ptr, offs_n,
                          sorted_rows, mask, k_start, k_stop, N, K, stride_wn, stride_sn, stride_hm, stride_hsm, BN,
                          BM, BK, WFMT, FP8_DOT, F16, X_DTYPE, DOT_DTYPE, IEEE)
        tile_mask = mask[None, :] & (offs_n[:, None] < N)
        ptrs = c_ptr + pair[None, :] * stride_cm + offs_n[:, None]
        if splits == 1:
            tl.store(ptrs, cast(cast(acc, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty), mask=tile_mask)
        else:
            offs = sorted_rows[None, :] * N + offs_n[:, None]
            tl.store(part_ptr + tl.program_id(2) * P * N + offs, acc, mask=tile_mask)
            if arrive_last(count_ptr, b * tl.num_programs(1) + tl.program_id(1), splits):
                acc = sum_partials(part_ptr, offs, tile_mask, splits, P * N)
                tl.store(ptrs, cast(cast(acc, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _combine_kernel(c_ptr, order_ptr, shared_ptr, y_ptr, D, top_k, stride_cm, stride_sm, stride_ym,
                    BLOCK: tl.constexpr, SHARED: tl.constexpr, ROWS: tl.constexpr):
    """y[t] = sum over the token's contributions in ascending expert order (fp32, starting from zero); SHARED: plus
    the shared expert's output, rounded to y's dtype (the reference's order: routed sum, shared, cast). order[t, j]:
    the slot of the token's j-th expert among its top_k contribution rows, or (ROWS) that contribution's row."""
    wait_for_inputs()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for j in range(top_k):
        row = tl.load(order_ptr + t * top_k + j).to(tl.int64)
        if not ROWS:
            row += t * top_k
        acc += tl.load(c_ptr + row * stride_cm + offs, mask=mask, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(shared_ptr + t * stride_sm + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_ym + offs, cast(acc, y_ptr.dtype.element_ty), mask=mask)


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if scale is None:
        return weight, 0, 0
    return scale.view(torch.uint8), scale.stride(0), scale.stride(1)


def grouped_moe(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor | None, w3: torch.Tensor, s3: torch.Tensor | None,
                w2: torch.Tensor, s2: torch.Tensor | None, limit: float, fp8_experts: bool = False,
                fp8_dot: bool = False, tile: dict | None = None, k_chunks: dict | None = None,
                f16_slices: bool | None = None, rows: bool | None = None, shared: torch.Tensor | None = None,
                grouped_gemm: bool | None = None, mma: bool | None = None) -> torch.Tensor:
    """The routed experts' sum [T, D] in fp32; with `shared` (the shared expert's output [T, D]) the MoE's output:
    that sum plus `shared`, in shared's dtype (the reference's order: routed sum, shared expert, cast).

    tokens [T, D] bf16/fp32; experts [T, k] integer ids; weights [T, k] fp32 routing weights.
    Weights stacked per projection, contiguous: w1, w3 [E, I, D] and w2 [E, D, I], either
    - FP4: packed int8 [E, N, K/2] with E8M0 scales [E, N, K/32],
    - FP4 re-encoded by fp4_to_fp8_weight (fp8_experts=True): e4m3 [E, N, K] with the same scales,
    - dense (scales None): bf16/fp32 [E, N, K].
    Quantized experts: exact bf16 dots on weight tiles dequantized in registers (W4A16 with the QDQ'd activations:
    the emulation's numbers up to fp32 summation order; packed FP4 ones through fp4_dot.fp4_scaled_dot, each
    value times its scale in bf16 so one dot spans every BK columns: at 32 tokens over 32 experts 749 -> 648 us
    per layer against the f16 slices, H200). fp8_dot=True: FP8 tensor cores (W4A8; e4m3 h and its
    scales between the kernels), Hopper's FP8 dots summing below fp32 precision.
    rows (default: packed FP4 experts up to rows_token_limit tokens, unless f16_slices or fp8_dot is asked): one
    activation row at a time on the CUDA cores (moe_rows.py), the same exact numbers without the tensor-core tiles'
    wasted rows and operand shuffles.
    f16_slices (asked for: benchmarks): packed FP4 tiles in 32-column fp16 slices (common.fp4_f16_dot_k_range: e4m3
    activations and h as fp16 values with their scales, each slice's dot rescaled into the accumulator).
    grouped_gemm (default: packed FP4 experts and bf16 tokens past the decode regime where moe_grouped_gemm's
    grouped_gemm_pays): the experts dequantized to bf16 once and torch's grouped GEMM, the same exact numbers.
    mma (default: with mma_choice.use_mma_moe on, packed FP4 experts on CUDA up to MOE_DECODE_MAX_TOKENS tokens, no
    other formulation asked for): the products on the tensor cores in blocks of 8 to 32 rows of one expert
    (moe_mma.py, fp4_mma.py), the rows formulation's numbers up to fp32 summation order, batch invariant.
    `tile`/`k_chunks` override the regime's tiling and decode splits (benchmarks only; mma takes `k_chunks` and a
    tile of only {"prefetch": bool})."""
    if tokens.dim() != 2 or experts.dim() != 2 or experts.shape[0] != tokens.shape[0]:
        raise ValueError(f"grouped_moe takes tokens [T, D] and experts [T, k]; got {tuple(tokens.shape)} and "
                         f"{tuple(experts.shape)}")
    if shared is not None and (shared.shape != tokens.shape or shared.stride(-1) != 1):
        raise ValueError(f"the shared expert's output {tuple(shared.shape)} must be row-major and match the tokens "
                         f"{tuple(tokens.shape)}")
    if weights.shape != experts.shape:
        raise ValueError(f"routing weights {tuple(weights.shape)} must match experts {tuple(experts.shape)}")
    if w1.shape != w3.shape or w2.shape[0] != w1.shape[0] or w2.shape[1] != tokens.shape[1]:
        raise ValueError(f"expert stacks do not fit: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} "
                         f"for hidden size {tokens.shape[1]} (expected w1, w3 [E, I, D(/2)] and w2 [E, D, I(/2)])")
    t, d = tokens.shape
    top_k = experts.shape[1]
    n_experts = w1.shape[0]
    quantized = s1 is not None
    fmt = (FMT_FP8_ROW if fp8_experts else FMT_FP4_ROW) if quantized else FMT_DENSE
    inter = w1.shape[1]
    if quantized and (d % 32 or inter % 32):
        raise ValueError(f"FP4 experts need hidden ({d}) and intermediate ({inter}) sizes divisible by 32")
    decode = t <= MOE_DECODE_MAX_TOKENS
    fp8_dot = quantized and fp8_dot
    mma_tile = tile is not None and set(tile) <= {"prefetch"}  # the only tiling option the tensor-core path has
    others = (fp8_dot, f16_slices is not None, rows is not None, grouped_gemm is not None, tile and not mma_tile)
    forced = (*others, k_chunks, tile)
    if mma is None:
        mma = (mma_moe_enabled() and tokens.is_cuda and fmt == FMT_FP4_ROW and decode and not any(forced)
               and d % 128 == 0 and inter % 128 == 0)
    elif mma and (fmt != FMT_FP4_ROW or any(others)):
        raise ValueError("mma takes packed FP4 experts and excludes the other formulations and tilings")
    if mma_tile and not mma:
        raise ValueError("a tile of only {'prefetch'} is the tensor-core experts' option: pass mma=True with it")
    route = weights.reshape(-1).to(torch.float32).contiguous()
    if mma:
        block_rows = mma_block_rows(t, top_k, n_experts)
        *schedule, order = moe_schedule(experts, n_experts, block_rows)
        contributions = mma_moe(tokens.contiguous(), route, schedule, block_rows, w1, s1, w3, s3, w2, s2, limit,
                                top_k, k_chunks, prefetch=tile.get("prefetch") if tile else None)
        return _combine(contributions, order, shared)
    if rows is None:
        rows = (t <= rows_token_limit(top_k, n_experts) and fmt == FMT_FP4_ROW and not fp8_dot
                and f16_slices is None)
    elif rows and (fmt != FMT_FP4_ROW or fp8_dot or f16_slices):
        raise ValueError("rows takes packed FP4 experts and excludes fp8_dot and f16_slices")
    if rows:
        tile = tile or ROWS_TILE
        *schedule, order = moe_schedule(experts, n_experts, tile["BM"])
        contributions = rows_moe(tokens.contiguous(), route, schedule, w1, s1, w3, s3, w2, s2, limit, top_k,
                                 ieee=tokens.device.type == "cpu", tile=tile, k_chunks=k_chunks)
        return _combine(contributions, order, shared)
    if grouped_gemm is None:
        grouped_gemm = (not decode and fmt == FMT_FP4_ROW and not fp8_dot and not f16_slices
                        and grouped_gemm_pays(tokens, t * top_k, n_experts))
    elif grouped_gemm and (fmt != FMT_FP4_ROW or fp8_dot or f16_slices or tokens.dtype != torch.bfloat16):
        raise ValueError("grouped_gemm takes packed FP4 experts and bf16 tokens, and excludes fp8_dot and f16_slices")
    if grouped_gemm:
        pair_of_row, *_, order = moe_schedule(experts, n_experts, MOE_PREFILL_TILE["BM"])
        contributions = grouped_gemm_moe(tokens.contiguous(), experts, route, pair_of_row, w1, s1, w3, s3, w2, s2,
                                         limit)
        row_of_pair = torch.empty_like(pair_of_row)
        row_of_pair[pair_of_row.long()] = torch.arange(pair_of_row.shape[0], dtype=torch.int32,
                                                       device=pair_of_row.device)
        return _combine(contributions, row_of_pair.view(t, top_k).gather(1, order.long()), shared, rows=True)
    tile = tile or (MOE_DECODE_TILE if decode else MOE_PREFILL_TILE)
    chunks = (k_chunks or MOE_DECODE_K_CHUNK) if decode else {"up": d, "down": inter}
    if f16_slices and (fmt != FMT_FP4_ROW or fp8_dot):
        raise ValueError("f16_slices takes packed FP4 experts and excludes fp8_dot")
    f16_slices = bool(f16_slices)
    pair_of_row, block_expert, block_start, block_end, order = moe_schedule(experts, n_experts, tile["BM"])
    act_dtype = tokens.dtype
    pairs = t * top_k
    x, xs, hs = tokens.contiguous(), None, None
    if fp8_dot or f16_slices:
        x, xs = fp8_act_quant(tokens, torch.float16 if f16_slices else torch.float8_e4m3fn)
        hs = torch.empty(pairs, inter // 32, dtype=torch.float32, device=tokens.device)
    elif quantized:
        x = fp8_act_qdq(tokens, torch.bfloat16)
    dot_dtype, round_dtype = (torch.bfloat16, act_dtype) if quantized else (w1.dtype, w1.dtype)
    # h is rounded to the activation dtype; once QDQ'd (quantized experts) it is exact in bf16
    h_dtype = torch.float8_e4m3fn if fp8_dot else torch.float16 if f16_slices else \
        torch.bfloat16 if quantized else act_dtype
    h = torch.empty(pairs, inter, dtype=h_dtype, device=tokens.device)
    x_dtype = dot_dtype
    dot_dtype = dot_dtype_for(tokens.device, dot_dtype)
    launched = launch_tile(tile, dot_dtype)
    dtypes = dict(X_DTYPE=_TL_DTYPES[x_dtype], DOT_DTYPE=_TL_DTYPES[dot_dtype], ROUND_DTYPE=_TL_DTYPES[round_dtype],
                  IEEE=dot_dtype == torch.float32, FP8_DOT=fp8_dot, F16=f16_slices, WFMT=fmt, BN=tile["BN"],
                  BM=tile["BM"], BK=tile["BK"], num_warps=launched["num_warps"], num_stages=launched["num_stages"])
    nb = block_expert.shape[0]
    scaled = fmt == FMT_FP4_ROW and not fp8_dot and not f16_slices  # fp4_dot.fp4_scaled_dot
    if f16_slices or scaled:  # the packed bytes as int32 words
        w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))
    # fp4_scaled_dot's slices need no mask: BK divides K (and so each split)
    up_tile, down_tile = (dict(tile, BK=slice_width(k, tile["BK"])) for k in (d, inter)) if scaled else (tile, tile)
    s1_arg, s_e, s_n = _scale_args(s1, w1)
    s3_arg, _, _ = _scale_args(s3, w3)
    xs_arg, hs_arg = (x, h) if xs is None else (xs, hs)
    grid, part, count, k_chunk, splits = _split_launch(nb, inter, d, chunks["up"], up_tile, 2 * pairs,
                                                       tokens.device)
    _moe_up_kernel[grid](
        x, xs_arg, w1, s1_arg, w3, s3_arg, h, hs_arg, route, pair_of_row, block_expert, block_start, block_end,
        part, count, pairs, inter, d, k_chunk, splits, top_k, float(limit), x.stride(0), xs_arg.stride(0),
        w1.stride(0), w1.stride(1), s_e, s_n, h.stride(0), hs_arg.stride(0), H_DTYPE=_TL_DTYPES[act_dtype],
        HAS_LIMIT=limit > 0, QDQ_OUT=quantized, **dict(dtypes, BK=up_tile["BK"]), **launch_options())
    contributions = torch.empty(pairs, d, dtype=act_dtype, device=tokens.device)
    s2_arg, s_e, s_n = _scale_args(s2, w2)
    grid, part, count, k_chunk, splits = _split_launch(nb, d, inter, chunks["down"], down_tile, pairs,
                                                       tokens.device)
    _moe_down_kernel[grid](
        h, hs_arg, w2, s2_arg, contributions, pair_of_row, block_expert, block_start, block_end, part, count, pairs,
        d, inter, k_chunk, splits, h.stride(0), hs_arg.stride(0), w2.stride(0), w2.stride(1), s_e, s_n,
        contributions.stride(0), **dict(dtypes, BK=down_tile["BK"]), **launch_options())
    return _combine(contributions, order, shared)


def _combine(contributions: torch.Tensor, order: torch.Tensor, shared: torch.Tensor | None, rows: bool = False
             ) -> torch.Tensor:
    """Each token's k contributions [T*k, D] summed in fp32 in ascending expert order (order [T, k]: the slots of
    the token's k rows, or with `rows` the contributions' rows themselves); with `shared` [T, D], plus it, in its
    dtype."""
    t, top_k = order.shape
    d = contributions.shape[1]
    y = torch.empty(t, d, dtype=torch.float32 if shared is None else shared.dtype, device=contributions.device)
    block = 1024
    shared_arg = y if shared is None else shared
    _combine_kernel[(t, triton.cdiv(d, block))](contributions, order, shared_arg, y, d, top_k,
                                                contributions.stride(0), shared_arg.stride(0), y.stride(0),
                                                BLOCK=block, SHARED=shared is not None, ROWS=rows, **launch_options())
    return y


def _split_launch(blocks: int, n: int, k: int, k_chunk: int, tile: dict, partial_rows: int, device: torch.device
                  ) -> tuple[tuple[int, int, int], torch.Tensor, torch.Tensor, int, int]:
    """(grid, partials, arrival counts, K columns per split, splits) of one projection: the split from the shapes
    alone (a whole number of BK blocks per split); partials [splits, partial_rows, n] fp32 only when split."""
    k_chunk = triton.cdiv(min(k_chunk, k), tile["BK"]) * tile["BK"]
    splits = triton.cdiv(k, k_chunk)
    grid = (blocks, triton.cdiv(n, tile["BN"]), splits)
    part, count = split_buffers(splits, (partial_rows, n), blocks * grid[1], device)
    return grid, part, count, k_chunk, splits
