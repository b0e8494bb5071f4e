"""The Engram layer's gated write of its value into every residual stream (the op; the tables, hashing and
projection are in layers/engram.py): the exact math, and one launch on CUDA inference instead of about twenty."""

from __future__ import annotations

import torch

from .dispatch import kernel_path
from .gpu_linear import triton_kernels
from .numerics import compute_dtype


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float, live: torch.Tensor | None) -> torch.Tensor:
    """out_c = h_c + gate_c * value for streams h [B,S,hc,D], keys [B,S,hc*D] (one per stream), value [B,S,D]:
    gate_c = sigmoid(signed_sqrt(<h_c, q_w k_w key_c> / (rms(h_c) rms(key_c) sqrt(D)))), 0 where live [B,S] is
    False; computed in fp32 (float64 for float64), returned in the streams' dtype."""
    hc, d = streams.shape[-2:]
    if kernel_path(streams) and key.shape[-1] == hc * d:
        return triton_kernels().engram_gate(streams, key, value, q_weight, k_weight, eps, live)
    acc = compute_dtype(streams)
    key = key.to(acc).unflatten(-1, (hc, d))
    weight = q_weight.to(acc) * k_weight.to(acc)
    h = streams.to(acc)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if live is not None:
        gate = gate.masked_fill(~live.unsqueeze(-1), 0)
    return (h + gate.unsqueeze(-1) * value.to(acc).unsqueeze(-2)).to(streams.dtype)
