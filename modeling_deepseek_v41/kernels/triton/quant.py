"""The reference's FP8 activation quantization on the GPU, and the exact FP4 -> FP8 weight re-encode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics import WEIGHT_BLOCK
from .common import abs_max, e2m1_value, pow2_ceil_scale, round_e4m3

GROUP = WEIGHT_BLOCK  # the FP8 activation QDQ's groups along a row


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, groups_per_row, stride_xm, stride_qm, stride_sm,
                      GROUPS: tl.constexpr, QDQ: tl.constexpr, NIBBLE_MAJOR: tl.constexpr):
    """Per row, per 32 values: scale 2^ceil(log2(max(amax, 1e-4) / 448)), values rounded to e4m3 (saturating).
    A program takes GROUPS consecutive groups of the flattened [rows, K/32] grid. QDQ: write the dequantized
    values (exact in bf16) to q; otherwise the e4m3 values to q (in q's dtype: e4m3, or fp16, which holds them
    exactly) and fp32 scales to s. NIBBLE_MAJOR (QDQ): column c of a row stored at (c % 8) * K/8 + c // 8, the
    order in which moe_rows multiplies packed FP4 words."""
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    valid = g < n_groups
    row = g // groups_per_row
    col0 = (g % groups_per_row) * 32
    lane = tl.arange(0, 32)[None, :]
    mask = valid[:, None]
    x = tl.load(x_ptr + (row * stride_xm + col0)[:, None] + lane, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(abs_max(x, 1), 1e-4)
    scale = pow2_ceil_scale(amax)
    q = round_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0))
    q_ptrs = q_ptr + (row * stride_qm + col0)[:, None] + lane
    if NIBBLE_MAJOR:
        col = col0[:, None] + lane
        q_ptrs = q_ptr + (row * stride_qm)[:, None] + (col % 8) * (groups_per_row * 4) + col // 8
    if QDQ:
        tl.store(q_ptrs, (q * scale[:, None]).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_sm + col0 // 32, scale, mask=valid)


def _check_act(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % GROUP:
        raise ValueError(f"FP8 activation quantization needs the last dim divisible by {GROUP}, got {x.shape[-1]}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


GROUPS_PER_PROGRAM = 64


def fp8_act_qdq(x: torch.Tensor, dtype: torch.dtype | None = None, nibble_major: bool = False) -> torch.Tensor:
    """numerics.fp8_act_qdq on the GPU: x [..., K] -> the QDQ'd values in `dtype` (default x.dtype). The values are
    e4m3 times powers of two >= 2^-22, so bf16 holds them exactly whatever x's dtype. nibble_major: each row's
    columns in moe_rows' order (column c at (c % 8) * K/8 + c // 8)."""
    rows = _check_act(x)
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    n_groups = rows.numel() // GROUP
    grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
    _act_quant_kernel[grid](rows, out, out, n_groups, rows.shape[1] // GROUP, rows.stride(0), out.stride(0), 0,
                            GROUPS=GROUPS_PER_PROGRAM, QDQ=True, NIBBLE_MAJOR=nibble_major)
    return out.view(*x.shape[:-1], x.shape[-1])


def fp8_act_quant(x: torch.Tensor, values_dtype: torch.dtype = torch.float8_e4m3fn
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K] in values_dtype, fp32 power-of-two scales [M, K/32]), the operands of an FP8
    dot (values_dtype e4m3) or of the FP4 experts' fp16 dots (values_dtype fp16: the e4m3 values exactly)."""
    rows = _check_act(x)
    m, k = rows.shape
    q = torch.empty(m, k, dtype=values_dtype, device=x.device)
    s = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
    n_groups = m * k // GROUP
    _act_quant_kernel[(triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)](
        rows, q, s, n_groups, k // GROUP, rows.stride(0), q.stride(0), s.stride(0), GROUPS=GROUPS_PER_PROGRAM,
        QDQ=False, NIBBLE_MAJOR=False)
    return q, s


@triton.jit
def _fp4_to_fp8_kernel(p_ptr, q_ptr, n_bytes, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    byte = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(q_ptr + 2 * offs, e2m1_value(byte & 15).to(tl.float8e4nv), mask=mask)
    tl.store(q_ptr + 2 * offs + 1, e2m1_value((byte >> 4) & 15).to(tl.float8e4nv), mask=mask)


def fp4_to_fp8_weight(packed: torch.Tensor) -> torch.Tensor:
    """Load-time re-encode of packed e2m1 [..., N, K/2] (int8/uint8) to e4m3 [..., N, K]: every e2m1 value is an
    e4m3 value, so this is exact and keeps the E8M0 scales [..., N, K/32] as they are (FMT_FP8_ROW). Costs 1 byte
    per weight instead of 0.5; the GEMM then skips the nibble unpacking."""
    packed = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.float8_e4m3fn, device=packed.device)
    n = packed.numel()
    block = 1024
    _fp4_to_fp8_kernel[(triton.cdiv(n, block),)](packed.view(torch.uint8), out, n, BLOCK=block)
    return out
