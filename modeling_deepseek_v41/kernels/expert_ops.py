"""The MoE's ops: routing (scores, biased top-k, routing weights), the clamped SwiGLU, and the routed experts'
formulations over weights stacked per projection [E, ...]. Routing and SwiGLU are the reference's math here and one
launch on CUDA inference (`triton/routing.py`); the stacked experts run the grouped Triton MoE there, and gather
the chosen experts' weights on another accelerator (few tokens, no host read)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .dispatch import fast_path, kernel_path
from .gpu_linear import grouped_moe
from .numerics import compute_dtype, dequantize_fp4_weight, fp8_act_qdq
from .sparse_attention import stable_topk_indices

FUSED_SCORING = "sqrtsoftplus"  # the released model's scoring, the one the routing launch computes
GATHER_MAX_TOKENS = 16  # up to this many tokens, an accelerator gathers the chosen experts' weights (no host sync)


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


def runs_stacked(tokens: torch.Tensor) -> bool:
    """Whether routed experts for these tokens run on stacked weights (`stacked_experts`): CUDA inference (the
    grouped kernel, any token count) or an accelerator's few-token steps (the gathered formulation)."""
    return kernel_path(tokens) or (fast_path(tokens) and tokens.shape[0] <= GATHER_MAX_TOKENS)


def sum_in_slot_order(contributions: torch.Tensor) -> torch.Tensor:
    """Each token's [T, k, D] contributions summed in slot order in the compute dtype (the reference's order once
    the slots hold ascending expert ids)."""
    y = torch.zeros(contributions.shape[0], contributions.shape[2], dtype=compute_dtype(contributions),
                    device=contributions.device)
    for slot in range(contributions.shape[1]):
        y = y + contributions[:, slot]
    return y


def stacked_experts(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, stacks: tuple,
                    limit: float, shared: torch.Tensor) -> torch.Tensor:
    """The MoE's output [T, D] in the tokens' dtype: the routed experts' sum in the compute dtype (each token's
    experts in ascending id, from the stacked weights w1, s1, w3, s3, w2, s2) plus the shared expert's output
    `shared`. On CUDA inference one grouped launch per projection, the sum and the shared expert in the last."""
    if kernel_path(tokens) and tokens.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if shared.dtype == tokens.dtype and shared.is_contiguous():
            return grouped_moe(tokens, experts, weights, stacks, limit, shared)
        return (grouped_moe(tokens, experts, weights, stacks, limit).to(compute_dtype(tokens)) + shared
                ).to(tokens.dtype)
    order = experts.argsort(dim=-1, stable=True)
    routed = sum_in_slot_order(gathered_swiglu(tokens, experts.gather(1, order), weights.gather(1, order), limit,
                                               *stacks))
    return (routed + shared).to(tokens.dtype)


def gathered_linear(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None
                    ) -> torch.Tensor:
    """Row n of x [N, in] through the stacked projection weight [E, out, in] of expert experts[n], with
    DeepseekV41Linear's numerics (FP8 activation QDQ and fp32 products for FP4 weights)."""
    weight = weight[experts]
    if scale is None:
        return torch.bmm(x.to(weight.dtype).unsqueeze(1), weight.transpose(1, 2)).squeeze(1)
    x = fp8_act_qdq(x)
    weight = dequantize_fp4_weight(weight, scale[experts])
    return torch.bmm(x.float().unsqueeze(1), weight.transpose(1, 2)).squeeze(1).to(x.dtype)


def gathered_swiglu(tokens: torch.Tensor, experts: torch.Tensor, route_weights: torch.Tensor, limit: float,
                    w1: torch.Tensor, s1: torch.Tensor | None, w3: torch.Tensor, s3: torch.Tensor | None,
                    w2: torch.Tensor, s2: torch.Tensor | None) -> torch.Tensor:
    """Contributions [T,k,D] of each token's experts [T,k] with routing weights [T,k], as DeepseekV41Expert
    computes them, from the stacked weights."""
    k = experts.shape[1]
    ids = experts.reshape(-1)
    x = tokens.repeat_interleave(k, dim=0)
    acc = compute_dtype(tokens)
    gate, up = gathered_linear(x, ids, w1, s1).to(acc), gathered_linear(x, ids, w3, s3).to(acc)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = route_weights.reshape(-1, 1) * (F.silu(gate) * up)
    return gathered_linear(h.to(tokens.dtype), ids, w2, s2).to(tokens.dtype).view(*experts.shape, -1)
