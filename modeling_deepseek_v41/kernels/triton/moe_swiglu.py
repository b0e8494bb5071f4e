"""The grouped MoE's SwiGLU epilogue, shared by its two formulations (moe.py's tensor-core tiles, moe_rows.py's
rows): the reference's roundings, clamps and FP8 QDQ of h, stored where the down projection reads it."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import abs_max, cast, pow2_ceil_scale, round_e4m3


@triton.jit
def swiglu_store(gate, up, route_ptr, h_ptr, hs_ptr, sorted_rows, mask, pair, offs_n, h_cols, N, limit, stride_hm,
                 stride_hsm, BN: tl.constexpr, BM: tl.constexpr, ROUND_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr,
                 HAS_LIMIT: tl.constexpr, QDQ_OUT: tl.constexpr, FP8_DOT: tl.constexpr, F16: tl.constexpr):
    """h = route weight * silu(gate) * up with the reference's roundings and clamps, gate and up [BN, BM] (columns
    offs_n of rows sorted_rows), stored at columns h_cols of h's rows. QDQ_OUT (quantized experts): h's FP8
    activation quantization per 32 along N (the tile holds whole groups), stored as its exact values (bf16 holds
    them), or for FP8_DOT and F16 as the e4m3 values (in h's dtype: e4m3, or fp16 for F16) and their scales (the
    down projection's operands)."""
    gate = cast(gate, ROUND_DTYPE).to(tl.float32)
    up = cast(up, ROUND_DTYPE).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    route = tl.load(route_ptr + pair, mask=mask, other=0.0)
    h = route[None, :] * (gate / (1.0 + tl.exp(-gate)) * up)
    h = cast(h, H_DTYPE).to(tl.float32)
    if QDQ_OUT:
        groups = tl.reshape(h, [BN // 32, 32, BM])
        amax = tl.maximum(abs_max(groups, 1), 1e-4)
        scale = pow2_ceil_scale(amax)
        q = round_e4m3(tl.minimum(tl.maximum(groups / scale[:, None, :], -448.0), 448.0))
        if FP8_DOT or F16:
            h = tl.reshape(q, [BN, BM]).to(h_ptr.dtype.element_ty)
            group = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
            tl.store(hs_ptr + sorted_rows[None, :] * stride_hsm + group[:, None], scale,
                     mask=mask[None, :] & (group[:, None] * 32 < N))
        else:
            h = cast(tl.reshape(q * scale[:, None, :], [BN, BM]), h_ptr.dtype.element_ty)
    else:
        h = cast(h, h_ptr.dtype.element_ty)
    tl.store(h_ptr + sorted_rows[None, :] * stride_hm + h_cols[:, None], h, mask=mask[None, :] & (offs_n[:, None] < N))
