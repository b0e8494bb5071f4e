"""The MoE's ops between its GEMMs: routing (scores, biased top-k, routing weights) and the clamped SwiGLU.
Each is the reference's math here, and one launch on CUDA inference (`triton/routing.py`)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .dispatch import kernel_path
from .numerics import compute_dtype
from .sparse_attention import stable_topk_indices

FUSED_SCORING = "sqrtsoftplus"  # the released model's scoring, the one the routing launch computes


def gate_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The gate's affinity scores from its logits: "softmax", "sigmoid" or (the released model's) sqrt-softplus."""
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def route(logits: torch.Tensor, scoring_func: str, bias: torch.Tensor, vision_bias: torch.Tensor | None,
          image_mask: torch.Tensor | None, top_k: int, normalize: bool, route_scale: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T,k], experts [T,k]) from fp32 router logits [T,E]: the biases (`vision_bias` on the
    `image_mask` tokens) only pick the experts (ties to the lower id); the weights are the unbiased scores,
    normalised when `normalize`, times `route_scale`."""
    if kernel_path(logits) and scoring_func == FUSED_SCORING:
        from .triton import route as fused
        return fused(logits, bias, vision_bias, image_mask, top_k, normalize, route_scale)
    scores = gate_scores(logits, scoring_func)
    bias = bias.to(logits.dtype)
    if image_mask is not None and vision_bias is not None:
        bias = torch.where(image_mask.unsqueeze(-1), vision_bias.to(logits.dtype), bias)
    experts = stable_topk_indices(scores + bias, top_k)
    weights = scores.gather(1, experts)
    if normalize and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, experts


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[weights *] silu(gate) * up in the compute dtype with the training clamps (up in [-limit, limit], gate at
    most limit), rounded to `out_dtype` (default: gate's)."""
    out_dtype = out_dtype or gate.dtype
    if kernel_path(gate) and not torch.is_grad_enabled():
        from .triton import swiglu as fused
        return fused(gate, up, limit, weights, out_dtype)
    acc = compute_dtype(gate)
    gate, up = gate.to(acc), up.to(acc)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weights is not None:
        h = weights * h
    return h.to(out_dtype)
