"""Mixture of experts: sqrt-softplus routing with separate text and image biases, clamped SwiGLU experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..kernels.expert_ops import (  # noqa: F401  (gate_scores: the layers' import point)
    gate_scores, route, runs_stacked, stacked_experts, sum_in_slot_order, swiglu,
)
from ..kernels.linear import STORAGE_FP8, compute_dtype_linear
from ..kernels.numerics import weight_dtype
from .linear import DeepseekV41Linear, linear_pair


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
        logits = compute_dtype_linear(x, self.weight)
        weights, experts = route(logits, self.scoring_func, self.bias, self.bias_vl, image_mask, self.top_k,
                                 self.norm_topk_prob, self.route_scale)
        return weights, experts, logits


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
        gate, up = linear_pair(x, self.w1, self.w3)  # both read x: one launch on the kernels
        return self.w2(swiglu(gate, up, self.swiglu_limit, weights, x.dtype))


PROJECTIONS = ("w1", "w2", "w3")


class ExpertStack:
    """The routed experts' weights (and scales) stacked [E, ...] per projection, so that a decode step can gather
    its chosen experts by a device index. Each expert's parameters become views of the stack: no second copy."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.storage = experts[0].w1.storage
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for name in PROJECTIONS:
            linears = [getattr(expert, name) for expert in experts]
            weight = torch.stack([linear.weight.detach() for linear in linears])
            scale = None if linears[0].scale is None else torch.stack([linear.scale.detach() for linear in linears])
            for index, linear in enumerate(linears):
                linear.weight.data = weight[index]
                if scale is not None:
                    linear.scale.data = scale[index]
            self.stacks[name] = (weight, scale)
        self.key = self.key_of(experts)

    @staticmethod
    def key_of(experts: nn.ModuleList) -> tuple[int, ...]:
        """Where the first and last experts' weights live: it changes when parameters are moved or replaced."""
        return tuple(getattr(experts[i], name).weight.data_ptr() for i in (0, -1) for name in PROJECTIONS)

    @staticmethod
    def can_stack(experts: nn.ModuleList) -> bool:
        """Dense or FP4 experts that all live on one device in one dtype."""
        weights = [expert.w1.weight for expert in experts]
        return experts[0].w1.storage != STORAGE_FP8 and all(
            w.device == weights[0].device and w.dtype == weights[0].dtype and not w.is_meta for w in weights)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """(w1, w1 scale, w3, w3 scale, w2, w2 scale), scales None for dense experts."""
        return tuple(t for name in ("w1", "w3", "w2") for t in self.stacks[name])


@torch.compiler.disable  # rebinds parameters: runs eagerly, once, even inside a compiled decode step
def _build_stack(experts: nn.ModuleList) -> ExpertStack | None:
    return ExpertStack(experts) if ExpertStack.can_stack(experts) else None


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
        self._stack: ExpertStack | None = None  # built on the first gathered (decode) call
        # expert parallelism (set by the tensor-parallel plan): the experts [start, end) this rank holds, and the
        # reduction that sums every rank's (token, slot) contributions
        self.expert_range: tuple[int, int] | None = None
        self.reduce_contributions: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,S,D] -> (y [B,S,D], router logits [B*S,E], experts [B*S,k])."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, logits = self.gate(tokens, None if image_mask is None else image_mask.reshape(-1))
        stack = self._expert_stack(tokens)
        if stack is not None:  # the stacked weights' formulations (an accelerator's inference)
            y = stacked_experts(tokens, experts, weights, stack.tensors(), self.experts[0].swiglu_limit,
                                self.shared_experts(tokens))
        else:
            order = experts.argsort(dim=-1, stable=True)  # per token, visit its experts in ascending id
            contributions = self._per_expert(tokens, experts.gather(1, order), weights.gather(1, order))
            if self.reduce_contributions is not None:
                contributions = self.reduce_contributions(contributions)
            y = sum_in_slot_order(contributions) + self.shared_experts(tokens)
        return y.to(x.dtype).view(shape), logits, experts

    def _per_expert(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Contributions [T,k,D]: each expert that was chosen (and is held here) runs once over its tokens (reads
        the ids back); the entries of experts held elsewhere stay zero."""
        contributions = tokens.new_zeros(*experts.shape, tokens.shape[-1])
        start, end = self.expert_range or (0, self.n_experts)
        if torch.compiler.is_compiling():
            return self._every_expert_masked(tokens, experts, weights, contributions, range(start, end))
        for expert_id in experts.unique().tolist():
            if not start <= expert_id < end:
                continue
            token_idx, slot = torch.nonzero(experts == expert_id, as_tuple=True)
            contributions[token_idx, slot] = self.experts[expert_id](tokens[token_idx],
                                                                     weights[token_idx, slot].unsqueeze(-1))
        return contributions

    def _every_expert_masked(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                             contributions: torch.Tensor, held: range) -> torch.Tensor:
        """`_per_expert` for a traced graph (torch.export, torch.compile): no shape depends on the routing, so every
        held expert runs over every token with a routing weight of zero where it was not chosen (its output is then
        exactly zero), and lands in the slot that chose it."""
        for expert_id in held:
            hit = experts == expert_id  # [T,k]; a token chooses an expert at most once
            route = torch.where(hit, weights, torch.zeros_like(weights)).sum(-1, keepdim=True)
            out = self.experts[expert_id](tokens, route)
            contributions = torch.where(hit.unsqueeze(-1), out.unsqueeze(1).to(contributions.dtype), contributions)
        return contributions

    def _expert_stack(self, tokens: torch.Tensor) -> ExpertStack | None:
        """The stacked expert weights when this call takes a stacked formulation (expert_ops.runs_stacked); None
        with expert parallelism (each rank runs its own experts)."""
        if self.expert_range is not None or not runs_stacked(tokens):
            return None
        if self._stack is None or (not torch.compiler.is_compiling()
                                   and self._stack.key != ExpertStack.key_of(self.experts)):
            self._stack = _build_stack(self.experts)
        return self._stack
