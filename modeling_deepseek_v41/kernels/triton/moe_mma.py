"""The routed experts at decode sizes through the tensor-core products of fp4_mma.py: the launches around them.

Five launches for a call's contributions (after the schedule, in blocks of 8, 16 or 32 rows of one expert): the tokens'
FP8 QDQ at mma_position, the up and gate projections in one (w1's tiles, then w3's), the split sums with the SwiGLU and
h's QDQ (written at mma_position), the down projection, its split sums rounded to the activation dtype and placed by
pair; moe.py combines them. The numbers are moe_rows.py's (the reference's roundings and clamps) up to fp32 summation
order. Off unless asked for (mma_choice.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, mma_position
from .linear import _TL_DTYPES
from .mma_choice import block_rows
from .moe_rows import ROWS_K_CHUNK, rows_per_expert
from .moe_swiglu import swiglu_store
from .quant import fp8_act_quant
from .splits import sum_partials
from .launch import launch_options, wait_for_inputs

FINISH_BN = 128  # h columns per finishing program: whole 128-column slices, so mma_position stays in the tile


@triton.jit
def _up_finish_kernel(part_ptr, route_ptr, pair_ptr, h_ptr, hs_ptr, rows, N, splits, limit, BN: tl.constexpr,
                      ROUND_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Sorted row r: gate and up (the partials' columns [0, N) and [N, 2N)) summed over the splits in order, the
    SwiGLU with the reference's roundings and clamps, h's FP8 QDQ per 32 columns: e4m3 values (fp16) at
    mma_position, fp32 scales."""
    wait_for_inputs()
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    gate = sum_partials(part_ptr, r * 2 * N + offs_n, n_ok, splits, rows * 2 * N)
    up = sum_partials(part_ptr + N, r * 2 * N + offs_n, n_ok, splits, rows * 2 * N)
    one = tl.full([1], 0, tl.int32) + r
    swiglu_store(gate[:, None], up[:, None], route_ptr, h_ptr, hs_ptr, one, one >= 0, tl.load(pair_ptr + one),
                 offs_n, mma_position(offs_n), N, limit, N, N // 32, BN, 1, ROUND_DTYPE, ROUND_DTYPE, HAS_LIMIT,
                 True, False, True)


@triton.jit
def _down_finish_kernel(part_ptr, pair_ptr, c_ptr, rows, N, splits, BN: tl.constexpr, ROUND_DTYPE: tl.constexpr):
    """Sorted row r's contribution: the splits summed in order, rounded to the activation dtype, stored at its pair."""
    wait_for_inputs()
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    total = sum_partials(part_ptr, r * N + offs_n, n_ok, splits, rows * N)
    pair = tl.load(pair_ptr + r).to(tl.int64)
    tl.store(c_ptr + pair * N + offs_n, cast(cast(total, ROUND_DTYPE).to(tl.float32), c_ptr.dtype.element_ty),
             mask=n_ok)


def up_finish(gate_up: torch.Tensor, route: torch.Tensor, pair_of_row: torch.Tensor, limit: float,
              act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h's e4m3 values [P, I] in fp16 at mma_position, their scales [P, I/32]) from the up projections' split
    partials [splits, P, 2I] (gate, then up; sorted rows); route [P] the pairs' routing weights."""
    splits, rows, n2 = gate_up.shape
    n = n2 // 2
    h = torch.empty(rows, n, dtype=torch.float16, device=gate_up.device)
    hs = torch.empty(rows, n // 32, dtype=torch.float32, device=gate_up.device)
    _up_finish_kernel[(rows, triton.cdiv(n, FINISH_BN))](gate_up, route, pair_of_row, h, hs, rows, n, splits,
                                                          float(limit), BN=FINISH_BN,
                                                          ROUND_DTYPE=_TL_DTYPES[act_dtype], HAS_LIMIT=limit > 0,
                                                          **launch_options())
    return h, hs


def down_finish(part: torch.Tensor, pair_of_row: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The contributions [pairs, D] (act_dtype, indexed by pair) from the down projection's split partials
    [splits, P, D] (sorted rows)."""
    splits, rows, n = part.shape
    out = torch.empty(rows, n, dtype=act_dtype, device=part.device)
    _down_finish_kernel[(rows, triton.cdiv(n, FINISH_BN))](part, pair_of_row, out, rows, n, splits, BN=FINISH_BN,
                                                            ROUND_DTYPE=_TL_DTYPES[act_dtype], **launch_options())
    return out


def mma_block_rows(tokens: int, top_k: int, n_experts: int) -> int:
    """The rows of one expert a program multiplies, from the rows a chosen expert sees under uniform routing (a
    block reads its expert once)."""
    return block_rows(rows_per_expert(tokens, top_k, n_experts))


def _mma_partials(*args, **kwargs) -> torch.Tensor:
    from .fp4_mma import fp4_mma_partials  # Gluon, imported on the GPU path only
    return fp4_mma_partials(*args, **kwargs)


def mma_moe(tokens: torch.Tensor, route: torch.Tensor, schedule: tuple, block_rows: int, w1: torch.Tensor,
            s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float,
            top_k: int, k_chunks: dict | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """The contributions [pairs, D] (activation dtype) of every (token, expert) pair, for moe.grouped_moe, as
    moe_rows.rows_moe gives them. schedule: moe_schedule's (pair_of_row, block_expert, block_start, block_end) for
    blocks of block_rows rows (mma_block_rows); w1, w3 [E, I, D/2] and w2 [E, D, I/2] packed FP4 with E8M0 scales
    [E, N, K/32]. k_chunks: K columns per split {"up", "down"}, by default the rows formulation's; prefetch:
    fp4_mma's (the next slice's loads issued ahead; None: its module's default)."""
    if tokens.shape[1] % 128 or w1.shape[1] % 128:
        raise ValueError(f"the tensor-core MoE decode takes hidden ({tokens.shape[1]}) and intermediate "
                         f"({w1.shape[1]}) sizes divisible by 128")
    pair_of_row, block_expert, block_start, block_end = schedule
    codes, xs = fp8_act_quant(tokens, torch.float16, mma_order=True)
    blocks = (block_expert, block_start, block_end)
    chunks = k_chunks or ROWS_K_CHUNK  # constants, so the split count is the shapes'
    gate_up = _mma_partials(codes, xs, w1, s1, pair_of_row, top_k, *blocks, chunks["up"], block_rows,
                            second=(w3, s3), prefetch=prefetch)
    h, hs = up_finish(gate_up, route, pair_of_row, limit, tokens.dtype)
    down = _mma_partials(h, hs, w2, s2, None, top_k, *blocks, chunks["down"], block_rows, prefetch=prefetch)
    return down_finish(down, pair_of_row, tokens.dtype)
