"""Mixture of experts: sqrt-softplus routing with separate text and image biases, clamped SwiGLU experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .numerics import compute_dtype, weight_dtype
from .quantized_linear import DeepseekV41Linear
from .row_invariant import row_invariant_linear
from .sparse_attention import stable_topk_indices


class DeepseekV41Gate(nn.Module):
    """Scores in fp32; the biases (`bias` for text, `bias_vl` for image-span tokens) only pick the experts, the
    routing weights come from the unbiased scores, normalised and multiplied by `routed_scaling_factor`."""

    def __init__(self, config, n_experts: int, top_k: int, has_vision_bias: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(n_experts, config.hidden_size, dtype=weight_dtype(torch.bfloat16)))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=weight_dtype(torch.float32)), requires_grad=False)
        if has_vision_bias:
            self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=weight_dtype(torch.float32)), requires_grad=False)
        else:
            self.register_parameter("bias_vl", None)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D]; image_mask [T] or None. Returns (weights [T,k], experts [T,k], router logits [T,E])."""
        acc = compute_dtype(x)
        logits = row_invariant_linear(x.to(acc), self.weight.to(acc))
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        bias = self.bias.to(acc)
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl.to(acc), bias)
        experts = stable_topk_indices(scores + bias, self.top_k)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, experts, logits


class DeepseekV41Expert(nn.Module):
    """SwiGLU with the training clamps: up in [-limit, limit], gate at most limit. The routing weight multiplies
    the activation in the compute dtype, before the down projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, storage: str, swiglu_limit: float) -> None:
        super().__init__()
        self.w1 = DeepseekV41Linear(hidden_size, intermediate_size, storage=storage)
        self.w2 = DeepseekV41Linear(intermediate_size, hidden_size, storage=storage)
        self.w3 = DeepseekV41Linear(hidden_size, intermediate_size, storage=storage)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        acc = compute_dtype(x)
        gate, up = self.w1(x).to(acc), self.w3(x).to(acc)
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class DeepseekV41MoE(nn.Module):
    """Routed experts plus one always-on shared expert. Each token sums its experts' outputs in ascending expert
    order in the compute dtype, then adds the shared expert (the reference's accumulation order)."""

    def __init__(self, config, n_experts: int, top_k: int, quantized: bool, has_vision_bias: bool) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.gate = DeepseekV41Gate(config, n_experts, top_k, has_vision_bias)
        expert_storage = "fp4" if quantized else "dense"
        self.experts = nn.ModuleList(
            DeepseekV41Expert(config.hidden_size, config.moe_intermediate_size, expert_storage, config.swiglu_limit)
            for _ in range(n_experts)
        )
        self.shared_experts = DeepseekV41Expert(config.hidden_size, config.moe_intermediate_size,
                                                "fp8" if quantized else "dense", config.swiglu_limit)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,S,D] -> (y [B,S,D], router logits [B*S,E], experts [B*S,k])."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, logits = self.gate(tokens, None if image_mask is None else image_mask.reshape(-1))
        order = experts.argsort(dim=-1, stable=True)  # per token, visit its experts in ascending id
        sorted_experts = experts.gather(1, order)
        sorted_weights = weights.gather(1, order)
        contributions = tokens.new_zeros(*sorted_experts.shape, shape[-1])
        for expert_id in sorted_experts.unique().tolist():
            token_idx, slot = torch.nonzero(sorted_experts == expert_id, as_tuple=True)
            contributions[token_idx, slot] = self.experts[expert_id](
                tokens[token_idx], sorted_weights[token_idx, slot].unsqueeze(-1))
        y = torch.zeros(tokens.shape, dtype=compute_dtype(x), device=x.device)
        for slot in range(contributions.shape[1]):
            y = y + contributions[:, slot]
        y = y + self.shared_experts(tokens)
        return y.to(x.dtype).view(shape), logits, experts
