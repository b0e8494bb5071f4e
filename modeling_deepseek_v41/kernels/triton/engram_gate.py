"""The Engram layer's gated write into the residual streams in one launch: a program per row and stream takes the
three sums over D (the stream's and the key's squares, their weighted product), the gate, and writes the stream.
kernels.engram_gate's math in its order; only the sums' order differs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, reduce_sum
from .launch import launch_options, wait_for_inputs

BLOCK_D = 1024  # columns per pass


@triton.jit
def _engram_gate_kernel(h_ptr, key_ptr, value_ptr, qw_ptr, kw_ptr, live_ptr, out_ptr, D, eps, inv_sqrt_d,
                        stride_h, stride_k, stride_v, HC: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                        HAS_LIVE: tl.constexpr):
    """Stream c of row r: out = h + gate * value, gate from <h, q_w k_w key> over the RMS of h and of key."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h_row = h_ptr + (r * HC + c) * stride_h
    k_row = key_ptr + r * stride_k + c * D
    h_square = tl.full([BD], 0.0, ACC)
    k_square = tl.full([BD], 0.0, ACC)
    product = tl.full([BD], 0.0, ACC)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        h = tl.load(h_row + d, mask=ok, other=0.0).to(ACC)
        k = tl.load(k_row + d, mask=ok, other=0.0).to(ACC)
        weight = tl.load(qw_ptr + c * D + d, mask=ok, other=0.0).to(ACC) * tl.load(kw_ptr + c * D + d, mask=ok,
                                                                                  other=0.0).to(ACC)
        h_square += h * h
        k_square += k * k
        product += h * weight * k
    rstd = tl.math.rsqrt(reduce_sum(h_square, 0) / D + eps) * tl.math.rsqrt(reduce_sum(k_square, 0) / D + eps)
    dot = reduce_sum(product, 0) * rstd * inv_sqrt_d
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-tl.where(dot < 0, -root, root)))
    if HAS_LIVE:
        gate = tl.where(tl.load(live_ptr + r) != 0, gate, 0.0)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = d < D
        h = tl.load(h_row + d, mask=ok, other=0.0).to(ACC)
        v = tl.load(value_ptr + r * stride_v + d, mask=ok, other=0.0).to(ACC)
        tl.store(out_ptr + (r * HC + c) * D + d, cast(h + gate * v, out_ptr.dtype.element_ty), mask=ok)


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float, live: torch.Tensor | None) -> torch.Tensor:
    """kernels.engram_gate's launch: streams [..., hc, D], key [..., hc*D], value [..., D] (rows contiguous along
    D), q/k weights [hc, D], live [...] bool or None -> the new streams."""
    hc, d = streams.shape[-2:]
    rows = streams.reshape(-1, hc, d)
    if rows.stride(-1) != 1 or rows.stride(1) != d:
        rows = rows.contiguous()
    keys = key.reshape(-1, hc * d)
    values = value.reshape(-1, d)
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    out = torch.empty(rows.shape, dtype=streams.dtype, device=streams.device)
    alive = rows if live is None else live.reshape(-1).contiguous()
    acc = tl.float64 if streams.dtype == torch.float64 else tl.float32
    if rows.shape[0]:
        _engram_gate_kernel[(rows.shape[0], hc)](
            rows, keys, values, q_weight.contiguous(), k_weight.contiguous(), alive, out, d, eps, d**-0.5,
            rows.stride(1), keys.stride(0), values.stride(0), HC=hc, BD=min(BLOCK_D, triton.next_power_of_2(d)),
            ACC=acc, HAS_LIVE=live is not None, num_warps=4, **launch_options())
    return out.view(streams.shape)
