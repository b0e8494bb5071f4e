"""Per-row kernels of a decode step: RMSNorm, the window entry (RMSNorm, RoPE, FP8 QDQ) and its store into a
window ring, each one launch with the exact ops' numerics (`kernels.linear.rms_norm`,
`kernels.sparse_attention.window_kv`, `cache.packed_rows.PackedRows` for FP8 rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, qdq_groups, reduce_sum
from .launch import launch_options, wait_for_inputs


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_x, stride_o, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """out = w * (x * rsqrt(mean(x^2) + eps)) in ACC, rounded to out's dtype; one row per program."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)  # rows x width pass 2^31 in a long prompt
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + r * stride_x + d, mask=ok, other=0.0).to(ACC)
    inv = tl.math.rsqrt(reduce_sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(ACC)
    tl.store(out_ptr + r * stride_o + d, cast(w * (x * inv), out_ptr.dtype.element_ty), mask=ok)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.linear.rms_norm on the GPU: x [..., D] -> x's dtype."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, d, eps, rows.stride(0), out.stride(0),
                                           BLOCK=triton.next_power_of_2(d), ACC=_acc(x.dtype), num_warps=4,
                                           **launch_options())
    return out.view(x.shape)


@triton.jit
def _window_kv_kernel(x_ptr, w_ptr, rot_ptr, out_ptr, eps, stride_x, D: tl.constexpr, ROPE: tl.constexpr,
                      ACC: tl.constexpr):
    """out = fp8_act_qdq(rope_tail(rms_norm(x))) for one row; every step rounds to out's dtype as the ops do."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)  # rows x width pass 2^31 in a long prompt
    HALF: tl.constexpr = D // 2
    c = tl.arange(0, HALF)
    t = tl.arange(0, 2)
    offs = 2 * c[:, None] + t[None, :]
    x = tl.load(x_ptr + r * stride_x + offs).to(ACC)
    inv = tl.math.rsqrt(reduce_sum(reduce_sum(x * x, 1), 0) / D + eps)
    y = cast(tl.load(w_ptr + offs).to(ACC) * (x * inv), out_ptr.dtype.element_ty).to(ACC)
    even, odd = tl.split(y)
    first = (D - ROPE) // 2
    in_rope = c >= first
    pair = tl.where(in_rope, c - first, 0)
    cos = tl.load(rot_ptr + r * ROPE + 2 * pair, mask=in_rope, other=1.0).to(ACC)
    sin = tl.load(rot_ptr + r * ROPE + 2 * pair + 1, mask=in_rope, other=0.0).to(ACC)
    even, odd = tl.where(in_rope, even * cos - odd * sin, even), tl.where(in_rope, even * sin + odd * cos, odd)
    y = tl.reshape(tl.join(cast(even, out_ptr.dtype.element_ty), cast(odd, out_ptr.dtype.element_ty)), [D])
    codes, scale = qdq_groups(y, D)  # from fp32, as numerics.fp8_act_qdq quantizes in every dtype
    y = tl.reshape(codes * scale[:, None], [D])
    tl.store(out_ptr + r * D + tl.arange(0, D), cast(y, out_ptr.dtype.element_ty))


def window_kv(x: torch.Tensor, weight: torch.Tensor, eps: float, rotation: torch.Tensor, rope_dim: int
              ) -> torch.Tensor:
    """x [..., D] (the wkv projection) with rotation [..., rope/2] complex -> the window entries [..., D]."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    rot = torch.view_as_real(rotation.to(torch.complex64)).reshape(rows.shape[0], rope_dim).contiguous()
    if rows.shape[0]:
        _window_kv_kernel[(rows.shape[0],)](rows, weight, rot, out, eps, rows.stride(0), D=d, ROPE=rope_dim,
                                            ACC=_acc(x.dtype), num_warps=4, **launch_options())
    return out.view(x.shape)


@triton.jit
def _ring_write_kernel(v_ptr, codes_ptr, scales_ptr, ring_pos_ptr, pos_ptr, S, slots,
                       stride_cb, stride_sb, stride_pb, D: tl.constexpr):
    """Encode row (b, s) of already-QDQ'd values as e4m3 codes with E8M0 scales per 32 and store it in ring slot
    position % slots with its position; padding (position < 0) writes nothing."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)  # rows x width pass 2^31 in a long prompt
    b = r // S
    p = tl.load(pos_ptr + r)
    if p >= 0:
        slot = p % slots
        v = tl.load(v_ptr + r * D + tl.arange(0, D))
        codes, scale = qdq_groups(v, D)
        exponent = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
        tl.store(codes_ptr + b * stride_cb + slot * D + tl.arange(0, D),
                 tl.reshape(codes, [D]).to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(scales_ptr + b * stride_sb + slot * (D // 32) + tl.arange(0, D // 32), exponent)
        tl.store(ring_pos_ptr + b * stride_pb + slot, p)


def ring_write(values: torch.Tensor, positions: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               ring_positions: torch.Tensor) -> None:
    """Store values [B, S, D] (FP8-QDQ'd window entries) at ring slot position % slots of their batch row, as
    FP8 codes [B, slots, D] and E8M0 scales [B, slots, D/32] (uint8), with the slot's position [B, slots].
    The non-negative positions must be distinct modulo the slot count (two programs never write one slot)."""
    batch, seq, d = values.shape
    if codes.stride(2) != 1 or codes.stride(1) != d or scales.stride(1) != d // 32:
        raise ValueError("ring rows must be contiguous within each batch row")
    _ring_write_kernel[(batch * seq,)](values.contiguous(), codes, scales, ring_positions,
                                       positions.reshape(-1).contiguous(), seq, codes.shape[1], codes.stride(0),
                                       scales.stride(0), ring_positions.stride(0), D=d, num_warps=4, **launch_options())
