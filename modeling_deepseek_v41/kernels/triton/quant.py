"""The reference's FP8 activation quantization and FP4 row quantization on the GPU, and the exact FP4 -> FP8 weight
re-encode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics import WEIGHT_BLOCK
from .common import abs_max, cast, e2m1_value, mma_position, pow2_ceil_scale, qdq_groups, round_e4m3
from .launch import launch_options, wait_for_inputs

GROUP = WEIGHT_BLOCK  # the FP8 activation QDQ's groups along a row
IN_ORDER, NIBBLE_MAJOR, MMA_ORDER = 0, 1, 2  # where a row's column c is stored (see _act_quant_kernel)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, groups_per_row, stride_xm, stride_qm, stride_sm,
                      GROUPS: tl.constexpr, QDQ: tl.constexpr, ORDER: tl.constexpr):
    """Per row, per 32 values: scale 2^ceil(log2(max(amax, 1e-4) / 448)), values rounded to e4m3 (saturating).
    A program takes GROUPS consecutive groups of the flattened [rows, K/32] grid. QDQ: write the dequantized
    values (exact in bf16) to q; otherwise the e4m3 values to q (in q's dtype: e4m3, or fp16, which holds them
    exactly) and fp32 scales to s. ORDER: column c of a row stored at c (IN_ORDER), at (c % 8) * K/8 + c // 8
    (NIBBLE_MAJOR, the order in which moe_rows multiplies packed FP4 words), or at common.mma_position(c)
    (MMA_ORDER, where the tensor-core decode kernels read it)."""
    wait_for_inputs()
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)  # rows x K passes 2^31 past 64K tokens
    valid = g < n_groups
    row = g // groups_per_row
    col0 = (g % groups_per_row) * 32
    lane = tl.arange(0, 32)[None, :]
    mask = valid[:, None]
    x = tl.load(x_ptr + (row * stride_xm + col0)[:, None] + lane, mask=mask, other=0.0)
    q, scale = qdq_groups(tl.reshape(x, [GROUPS * 32]), GROUPS * 32)  # the one QDQ formula of the kernels
    q_ptrs = q_ptr + (row * stride_qm + col0)[:, None] + lane
    if ORDER == 1:  # NIBBLE_MAJOR
        col = col0[:, None] + lane
        q_ptrs = q_ptr + (row * stride_qm)[:, None] + (col % 8) * (groups_per_row * 4) + col // 8
    elif ORDER == 2:  # MMA_ORDER
        q_ptrs = q_ptr + (row * stride_qm)[:, None] + mma_position(col0[:, None] + lane)
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
                            GROUPS=GROUPS_PER_PROGRAM, QDQ=True, ORDER=NIBBLE_MAJOR if nibble_major else IN_ORDER,
                            **launch_options())
    return out.view(*x.shape[:-1], x.shape[-1])


def fp8_act_quant(x: torch.Tensor, values_dtype: torch.dtype = torch.float8_e4m3fn, mma_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K] in values_dtype, fp32 power-of-two scales [M, K/32]), the operands of an FP8
    dot (values_dtype e4m3) or of the FP4 experts' fp16 dots (values_dtype fp16: the e4m3 values exactly).
    mma_order: each row's values at common.mma_position (K a multiple of 128), as the tensor-core decode kernels
    read them; the scales stay in column order."""
    rows = _check_act(x)
    m, k = rows.shape
    if mma_order and k % 128:
        raise ValueError(f"the tensor-core decode order takes rows of whole 128-column slices, got {k} columns")
    q = torch.empty(m, k, dtype=values_dtype, device=x.device)
    s = torch.empty(m, k // GROUP, dtype=torch.float32, device=x.device)
    n_groups = m * k // GROUP
    _act_quant_kernel[(triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)](
        rows, q, s, n_groups, k // GROUP, rows.stride(0), q.stride(0), s.stride(0), GROUPS=GROUPS_PER_PROGRAM,
        QDQ=False, ORDER=MMA_ORDER if mma_order else IN_ORDER, **launch_options())
    return q, s


@triton.jit
def _fp4_to_fp8_kernel(p_ptr, q_ptr, n_bytes, BLOCK: tl.constexpr):
    wait_for_inputs()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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
    _fp4_to_fp8_kernel[(triton.cdiv(n, block),)](packed.view(torch.uint8), out, n, BLOCK=block, **launch_options())
    return out


@triton.jit
def _rotated(x, g, live, rot_ptr, groups_per_row, rows_per_rotation, BLOCK: tl.constexpr, ROPE: tl.constexpr,
             DTYPE: tl.constexpr):
    """Groups x [GROUPS, BLOCK] (in the rotation's precision) with those in their row's last ROPE columns rotated as
    kernels.rope rotates them (interleaved pairs times the row's cos + i sin), rounded to DTYPE."""
    GROUPS: tl.constexpr = x.shape[0]
    tail = g % groups_per_row - (groups_per_row - ROPE // BLOCK)
    in_rope = (tail >= 0) & live
    rot = rot_ptr + ((g // groups_per_row) // rows_per_rotation)[:, None] * ROPE
    pair = tl.where(in_rope, tail, 0)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    cos = tl.load(rot + 2 * pair, mask=in_rope[:, None], other=1.0).to(x.dtype)
    sin = tl.load(rot + 2 * pair + 1, mask=in_rope[:, None], other=0.0).to(x.dtype)
    even, odd = tl.split(tl.reshape(x, [GROUPS, BLOCK // 2, 2]))
    turned_even = tl.where(in_rope[:, None], even * cos - odd * sin, even)
    turned_odd = tl.where(in_rope[:, None], even * sin + odd * cos, odd)
    return tl.reshape(tl.join(cast(turned_even, DTYPE), cast(turned_odd, DTYPE)), [GROUPS, BLOCK])


@triton.jit
def _fp4_rows_kernel(x_ptr, out_ptr, scale_ptr, rot_ptr, rotated_ptr, n_groups, groups_per_row, rows_per_rotation,
                     BLOCK: tl.constexpr, GROUPS: tl.constexpr, E4M3_SCALE: tl.constexpr, PACKED: tl.constexpr,
                     ROPE: tl.constexpr, ROT: tl.constexpr):
    """numerics.fp4_qdq (PACKED False: the dequantized values to out) or numerics.fp4_quantize_rows (PACKED: the
    packed e2m1 bytes to out, the fp32 scales to scale_ptr) of GROUPS groups of BLOCK consecutive values. Scale:
    E4M3 of amax / 6 (division correctly rounded, as the CPU's) or the E8M0 power of two 2^ceil(log2(amax / 6));
    codes rounded to nearest even on the e2m1 grid (ties at 0.75, 1.75, 3.5 go up, the others down).
    ROPE > 0: each row's last ROPE values are first rotated (`_rotated`, in ROT's precision) and, PACKED, the
    rotated values stored to rotated_ptr."""
    wait_for_inputs()
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)  # rows x K passes 2^31 past 64K tokens
    live = g < n_groups
    lane = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + g[:, None] * BLOCK + lane[None, :], mask=live[:, None], other=0.0)
    if ROPE > 0:
        x = _rotated(x.to(ROT), g, live, rot_ptr, groups_per_row, rows_per_rotation, BLOCK, ROPE,
                     x_ptr.dtype.element_ty)
        if PACKED:
            tl.store(rotated_ptr + g[:, None] * BLOCK + lane[None, :], x, mask=live[:, None])
    x = x.to(tl.float32)
    amax = abs_max(x, 1)
    if E4M3_SCALE:
        scale = round_e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0))
        v = tl.math.div_rn(x, scale[:, None])
    else:
        scale = pow2_ceil_scale(tl.maximum(amax, 6.0 * 2.0**-126), 0.16666666666666666)
        v = x / scale[:, None]  # a power of two: exact
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    m = tl.abs(v)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + (m >= 1.75).to(tl.int32)
            + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    code = code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)  # the sign bit, -0.0 included
    if PACKED:
        even, odd = tl.split(tl.reshape(code, [GROUPS, BLOCK // 2, 2]))
        half = tl.arange(0, BLOCK // 2)
        tl.store(out_ptr + g[:, None] * (BLOCK // 2) + half[None, :], (even | (odd << 4)).to(tl.uint8),
                 mask=live[:, None])
        tl.store(scale_ptr + g, scale, mask=live)
    else:
        values = e2m1_value(code & 7) * scale[:, None]
        # the sign set as a bit, so -0.0 survives whatever the compiler makes of negating a zero (it did not on sm90)
        values = (values.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
        tl.store(out_ptr + g[:, None] * BLOCK + lane[None, :], cast(values, out_ptr.dtype.element_ty),
                 mask=live[:, None])


def fp4_rows(x: torch.Tensor, block: int, scale_format: str, packed: bool, rotation: torch.Tensor | None = None,
             rope_dim: int = 0):
    """numerics.fp4_qdq(x, block, scale_format) (packed False: x's shape and dtype) or numerics.fp4_quantize_rows
    (packed: uint8 bytes [..., K/2] and fp32 scales [..., K/block]) in one launch, bit for bit. With `rotation`
    ([...lead, rope_dim/2] complex, shared by the rows of trailing dims it lacks, e.g. heads) the last rope_dim
    values of each row are first rotated as kernels.rope.apply_rope_tail does; packed then returns (rotated
    values, bytes, scales)."""
    if scale_format not in ("e4m3", "e8m0"):
        raise ValueError(f"unknown FP4 scale format {scale_format!r}; expected 'e4m3' or 'e8m0'")
    if x.shape[-1] % block or rope_dim % block or rope_dim > x.shape[-1]:
        raise ValueError(f"FP4 rows need the last dim ({x.shape[-1]}) and the rotated tail ({rope_dim}) divisible "
                         f"by the block ({block})")
    flat = x.contiguous()
    n_groups = flat.numel() // block
    grid = (triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)
    if packed:
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.float32, device=x.device)
    else:
        out, scales = torch.empty_like(flat), flat
    rotated, rot, rows_per_rotation = flat, flat, 1
    if rotation is not None:
        wide = x.dtype == torch.float64  # kernels.rope's product: complex128 for float64, complex64 otherwise
        rot = torch.view_as_real(rotation.to(torch.complex128 if wide else torch.complex64)).reshape(-1, rope_dim)
        rows_per_rotation = max(1, (flat.numel() // x.shape[-1]) // max(1, rot.shape[0]))
        rot = rot.contiguous()
        rotated = torch.empty_like(flat) if packed else flat
    if n_groups:
        _fp4_rows_kernel[grid](flat, out, scales, rot, rotated, n_groups, x.shape[-1] // block, rows_per_rotation,
                               BLOCK=block, GROUPS=GROUPS_PER_PROGRAM, E4M3_SCALE=scale_format == "e4m3",
                               PACKED=packed, ROPE=rope_dim if rotation is not None else 0,
                               ROT=tl.float64 if rot.dtype == torch.float64 else tl.float32, **launch_options())
    if rotation is not None and packed:
        return rotated, out, scales
    return (out, scales) if packed else out
