"""The launches around the candidate FP4 MMA kernel (fp4_mma.py): the split sums with the SwiGLU and h's QDQ
(written in the weights' order) after the up projections, the split sums rounded to the activation dtype
after the down projection, and `mma_moe`, the routed experts' sum as `grouped_moe` gives it. Plain Triton, so the
interpreter tests these on the CPU; the MMA kernel itself needs the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling_deepseek_v41.kernels.triton.common import cast
from modeling_deepseek_v41.kernels.triton.linear import _TL_DTYPES
from modeling_deepseek_v41.kernels.triton.moe import _combine
from modeling_deepseek_v41.kernels.triton.moe_schedule import moe_schedule
from modeling_deepseek_v41.kernels.triton.moe_swiglu import swiglu_store
from shared import FP4_WORDS, NATURAL, act_quant_permuted, slice_position

FINISH_BN = 128  # h columns per program: whole 128-column slices, so the permuted positions stay in the tile


@triton.jit
def _sum_splits(part_ptr, offs, mask, splits, stride_split):
    total = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        total += tl.load(part_ptr + s * stride_split + offs, mask=mask, other=0.0)
    return total


@triton.jit
def _up_finish_kernel(part_ptr, route_ptr, pair_ptr, h_ptr, hs_ptr, rows, N, splits, limit, BN: tl.constexpr,
                      ROUND_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr, ORDER: tl.constexpr):
    """Sorted row r: gate and up (the partials' columns [0, N) and [N, 2N)) summed over the splits in order, the
    SwiGLU with the reference's roundings and clamps, h's FP8 QDQ per 32 columns: e4m3 values (fp16) at the
    order's positions, fp32 scales."""
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    gate = _sum_splits(part_ptr, r * 2 * N + offs_n, n_ok, splits, rows * 2 * N)
    up = _sum_splits(part_ptr + N, r * 2 * N + offs_n, n_ok, splits, rows * 2 * N)
    one = tl.full([1], 0, tl.int32) + r
    swiglu_store(gate[:, None], up[:, None], route_ptr, h_ptr, hs_ptr, one, one >= 0, tl.load(pair_ptr + one),
                 offs_n, slice_position(offs_n, ORDER), N, limit, N, N // 32, BN, 1, ROUND_DTYPE, ROUND_DTYPE,
                 HAS_LIMIT, True, False, True)


@triton.jit
def _down_finish_kernel(part_ptr, pair_ptr, c_ptr, rows, N, splits, BN: tl.constexpr, ROUND_DTYPE: tl.constexpr):
    """Sorted row r's contribution: the splits summed in order, rounded to the activation dtype, stored at its pair."""
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    total = _sum_splits(part_ptr, r * N + offs_n, n_ok, splits, rows * N)
    pair = tl.load(pair_ptr + r).to(tl.int64)
    tl.store(c_ptr + pair * N + offs_n, cast(cast(total, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty),
             mask=n_ok)


def up_finish(gate_up: torch.Tensor, route: torch.Tensor, pair_of_row: torch.Tensor, limit: float,
              act_dtype: torch.dtype, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h's e4m3 values [P, I] in fp16 in an order's positions, their scales [P, I/32]) from the up projections'
    split partials [splits, P, 2I] (gate, then up; sorted rows); route [P] the pairs' routing weights."""
    splits, rows, n2 = gate_up.shape
    n = n2 // 2
    h = torch.empty(rows, n, dtype=torch.float16, device=gate_up.device)
    hs = torch.empty(rows, n // 32, dtype=torch.float32, device=gate_up.device)
    _up_finish_kernel[(rows, triton.cdiv(n, FINISH_BN))](gate_up.contiguous(), route, pair_of_row, h, hs, rows, n,
                                                          splits, float(limit), BN=FINISH_BN,
                                                          ROUND_DTYPE=_TL_DTYPES[act_dtype], HAS_LIMIT=limit > 0,
                                                          ORDER=order)
    return h, hs


def down_finish(part: torch.Tensor, pair_of_row: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The contributions [pairs, D] (act_dtype, indexed by pair) from the down projection's split partials
    [splits, P, D] (sorted rows)."""
    splits, rows, n = part.shape
    out = torch.empty(rows, n, dtype=act_dtype, device=part.device)
    _down_finish_kernel[(rows, triton.cdiv(n, FINISH_BN))](part, pair_of_row, out, rows, n, splits, BN=FINISH_BN,
                                                            ROUND_DTYPE=_TL_DTYPES[act_dtype])
    return out


def mma_moe(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
            w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float,
            shared: torch.Tensor | None = None, natural: bool = True, k_chunks=(1280, 1152)) -> torch.Tensor:
    """moe.grouped_moe's result for packed FP4 experts through the MMA kernel, in seven launches: tokens [T, D],
    experts and weights [T, k]; w1, w3 [E, I, D/8] and w2 [E, D, I/8] the stacks' int32 words (natural_fp4_words of
    the shipped bytes, or permute_fp4_words), their E8M0 scales s1, s3 [E, I, D/32] and s2. GPU only (Gluon)."""
    from fp4_mma import BM, grouped_fp4_mma
    order = NATURAL if natural else FP4_WORDS
    t, top_k = experts.shape
    pair_of_row, block_expert, block_start, block_end, order_of_pairs = moe_schedule(experts, w1.shape[0], BM.value)
    route = weights.reshape(-1).to(torch.float32).contiguous()
    codes, xs = act_quant_permuted(tokens, order)
    row_token = torch.div(pair_of_row, top_k, rounding_mode="floor").to(torch.int32)
    blocks = (block_expert, block_start, block_end)
    gate_up = grouped_fp4_mma(codes, xs, w1, s1, row_token, *blocks, k_chunks[0], second=(w3, s3), natural=natural)
    h, hs = up_finish(gate_up, route, pair_of_row, limit, tokens.dtype, order)
    down = grouped_fp4_mma(h, hs, w2, s2, None, *blocks, k_chunks[1], natural=natural)
    return _combine(down_finish(down, pair_of_row, tokens.dtype), order_of_pairs, shared)
