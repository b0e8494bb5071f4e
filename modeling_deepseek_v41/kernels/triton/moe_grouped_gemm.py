"""The grouped MoE's prefill formulation for packed FP4 experts: the experts' weights dequantized exactly to bf16
once per call, then torch's grouped GEMM (`torch._grouped_mm`, CUTLASS on sm90) over the expert-sorted rows.

The tiles of moe.py unpack every FP4 weight tile again for each block of 64 rows and feed the tensor cores from
registers: 56 TFLOP/s for the up projection of a 4,096-token prefill on the H200, where the grouped GEMM ran at 710.
A bf16 copy of an expert costs 4.5 bytes per weight (FP4 read, bf16 written and read back), paid per call: it pays
where an expert sees enough rows (grouped_gemm_pays). The numbers are the emulation's: exact bf16 operands (FP4 x
E8M0 weights, QDQ'd activations), fp32 sums, each projection rounded once to bf16, then the SwiGLU, h's FP8 QDQ and
the sum in ascending expert order of moe.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import e8m0_byte_value
from .fp4_dot import slice_width
from .quant import fp8_act_qdq
from .routing import swiglu
from .launch import launch_options, wait_for_inputs

GROUP_BYTES = 3 << 30  # bf16 expert copies held at a time (a 384-expert layer runs in groups of experts)
# the copies cost the same whatever the rows; the tiles grow with them (H200, one 384-expert layer, fp4_to_bf16:
# 64 rows per expert 20.9 ms against the tiles' 34.7, 256 rows 27.9 against 107.7; about 40 rows break even)
MIN_ROWS_PER_EXPERT = 64


def grouped_gemm_pays(tokens: torch.Tensor, pairs: int, n_experts: int) -> bool:
    """Whether the grouped GEMM is the default for this call: bf16 tokens on a Hopper or newer GPU whose torch has
    it, with enough rows per expert to pay for the copies."""
    return (hasattr(torch, "_grouped_mm") and tokens.dtype == torch.bfloat16 and tokens.is_cuda
            and torch.cuda.get_device_capability(tokens.device) >= (9, 0) and pairs >= MIN_ROWS_PER_EXPERT * n_experts)


@triton.jit
def _fp4_bf16_kernel(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """out [N, K] bf16 = packed FP4 w [N, K/2] (the even column in the low nibble) times the E8M0 scales s [N, K/32],
    BK columns of BN rows per program. A nibble s|e1 e0|m is the e4m3 byte s|0 0 e1 e0|m 0 0, its value times 2^-6:
    exact, as is every product with a power of two that bf16 then holds."""
    wait_for_inputs()
    rows = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)  # a 384-expert stack passes 2^31 elements
    ok = rows < N
    half = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    byte = tl.load(w_ptr + rows[:, None] * (K // 2) + half[None, :], mask=ok[:, None], other=0).to(tl.int32)
    low, high = byte & 15, (byte >> 4) & 15
    low = (((low & 8) << 4) | ((low & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    high = (((high & 8) << 4) | ((high & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    values = tl.reshape(tl.join(low, high), [BN, BK // 32, 32])
    group = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    scale = e8m0_byte_value(tl.load(s_ptr + rows[:, None] * (K // 32) + group[None, :], mask=ok[:, None], other=127))
    values = tl.reshape(values * (64.0 * scale)[:, :, None], [BN, BK])
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], values.to(tl.bfloat16), mask=ok[:, None])


def fp4_to_bf16(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed FP4 [..., N, K/2] with E8M0 scales [..., N, K/32] (K a multiple of 32) -> exact bf16 [..., N, K]."""
    *lead, n, half = packed.shape
    k = 2 * half
    rows = packed.reshape(-1, half).contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.bfloat16, device=packed.device)
    bk = slice_width(k, 256)
    if rows.shape[0]:
        _fp4_bf16_kernel[(triton.cdiv(rows.shape[0], 32), k // bk)](
            rows, scale.reshape(-1, k // 32).contiguous().view(torch.uint8), out, rows.shape[0], k, BN=32, BK=bk,
            num_warps=4, **launch_options())
    return out.view(*lead, n, k)


def _dequantized(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Experts [g, N, K/2] packed FP4 with E8M0 scales [g, N, K/32] -> their exact bf16 values, as the grouped
    GEMM's right operand [g, K, N] (column-major: each expert's rows stay contiguous)."""
    return fp4_to_bf16(packed, scale).transpose(1, 2)


def grouped_gemm_moe(tokens: torch.Tensor, experts: torch.Tensor, route: torch.Tensor, pair_of_row: torch.Tensor,
                     w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
                     s2: torch.Tensor, limit: float) -> torch.Tensor:
    """The contributions [pairs, D] (bf16) of every (token, expert) pair in the expert-sorted order of
    `pair_of_row` (row r is pair pair_of_row[r]), for moe.grouped_moe.

    tokens [T, D] bf16; experts [T, k] ids; route [T*k] fp32 routing weights; pair_of_row [T*k] the pairs sorted
    by expert (stable); w1, w3 [E, I, D/2] and w2 [E, D, I/2] packed FP4 with E8M0 scales [E, N, K/32]. Reads the
    experts' row counts back once when the experts run in more than one group (a prefill; decode steps take
    moe_rows or the tiles)."""
    top_k, n_experts, inter = experts.shape[1], w1.shape[0], w1.shape[1]
    d = tokens.shape[1]
    rows_of = pair_of_row.long()
    x = fp8_act_qdq(tokens, torch.bfloat16).index_select(0, torch.div(rows_of, top_k, rounding_mode="floor"))
    route = route.index_select(0, rows_of).unsqueeze(1)
    ids = experts.reshape(-1).long()  # counted by scatter_add: CUDA's bincount reads the largest id back
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    ends = counts.cumsum(0).to(torch.int32)
    per_expert_bytes = 3 * inter * d * 2
    group = max(1, min(n_experts, GROUP_BYTES // per_expert_bytes))
    # where each group of experts' rows begins and ends: the one host read, none when one group takes them all
    bounds = [0] + ends.tolist() if group < n_experts else None
    pieces = []  # each group's rows, in sorted order: no scatter back to pair order (the sum reads them there)
    for e0 in range(0, n_experts, group):
        e1 = min(n_experts, e0 + group)
        r0, r1 = (bounds[e0], bounds[e1]) if bounds else (0, rows_of.shape[0])
        if r0 == r1:
            continue
        offs = ends[e0:e1] - r0
        rows = x[r0:r1]
        gate = torch._grouped_mm(rows, _dequantized(w1[e0:e1], s1[e0:e1]), offs=offs)
        up = torch._grouped_mm(rows, _dequantized(w3[e0:e1], s3[e0:e1]), offs=offs)
        h = fp8_act_qdq(swiglu(gate, up, limit, route[r0:r1], torch.bfloat16), torch.bfloat16)
        del gate, up
        pieces.append(torch._grouped_mm(h, _dequantized(w2[e0:e1], s2[e0:e1]), offs=offs))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else tokens.new_empty(0, d)
