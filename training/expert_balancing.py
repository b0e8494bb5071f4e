"""Auxiliary-loss-free expert balancing with one bias set per modality, plus the small sequence-level balance loss.

Text tokens' expert loads move each gate's `bias`, image-span tokens' loads move `bias_vl` (speed 0.001 each, by
the sign of the load's distance from the mean). The biases only choose experts; the routing weights stay the raw
scores (moe.py). The sequence-level loss (weight 1e-4) is added to the model's training loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import TrainerCallback

from modeling_deepseek_v41.layers.moe import DeepseekV41Gate

from .lm import router_scores


def expert_counts(experts: torch.Tensor, n_experts: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the chosen slots in `experts` [T, k] went to each expert, over the tokens where `tokens` [T]
    is True (all tokens when None); float [E]."""
    chosen = experts if tokens is None else experts[tokens]
    return torch.bincount(chosen.reshape(-1), minlength=n_experts).float()


def sequence_balance_loss(logits: torch.Tensor, experts: torch.Tensor, batch_size: int, scoring_func: str,
                          valid: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i f_i P_i per sequence, averaged over the sequences, for one MoE layer.

    logits [B*S, E] and experts [B*S, k] in the model's (batch, position) order; valid [B, S] marks real tokens.
    f_i = E / (k T) * (slots of expert i in the sequence), P_i = mean over the sequence of the scores normalised
    over all experts. It equals 1 when every expert gets the same load and the same mean score.
    """
    n_experts, top_k = logits.shape[-1], experts.shape[-1]
    scores = router_scores(logits, scoring_func).view(batch_size, -1, n_experts)
    mask = torch.ones(scores.shape[:2], device=scores.device) if valid is None else valid.float()
    slots = F.one_hot(experts, n_experts).sum(dim=-2).view(batch_size, -1, n_experts).float()
    tokens = mask.sum(dim=1).clamp_min(1.0)
    load = (slots * mask.unsqueeze(-1)).sum(dim=1) * (n_experts / top_k) / tokens.unsqueeze(-1)
    mean_score = (scores * mask.unsqueeze(-1)).sum(dim=1) / tokens.unsqueeze(-1)
    per_sequence = (load * mean_score).sum(dim=-1)
    has_tokens = mask.sum(dim=1) > 0
    return per_sequence[has_tokens].mean() if bool(has_tokens.any()) else per_sequence.sum() * 0


class ExpertBalancer:
    """Collects each training forward's expert loads per modality through hooks on the MoE gates, adds the
    sequence-level balance loss to the model's loss, and moves the biases in `update_biases()` (call it once per
    optimizer step; `ExpertBalanceCallback` does this for Trainer). Eval-mode forwards are ignored."""

    def __init__(self, model: nn.Module, update_speed: float = 1e-3, balance_loss_weight: float = 1e-4) -> None:
        self.model = model
        self.update_speed = update_speed
        self.balance_loss_weight = balance_loss_weight
        self.gates = [m for m in model.modules() if isinstance(m, DeepseekV41Gate)]
        self.text_counts = {id(g): torch.zeros(g.weight.shape[0]) for g in self.gates}
        self.image_counts = {id(g): torch.zeros(g.weight.shape[0]) for g in self.gates}
        self.last_balance_loss: torch.Tensor | None = None
        self.last_stats: dict[str, float] = {}
        self._handles: list[Any] = []
        self._records: list[tuple[DeepseekV41Gate, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._batch: tuple[int, torch.Tensor | None] | None = None

    def attach(self) -> "ExpertBalancer":
        """Register the hooks (idempotent)."""
        if self._handles:
            return self
        self._handles.append(self.model.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._end, with_kwargs=True))
        self._handles += [gate.register_forward_hook(self._record) for gate in self.gates]
        return self

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._records = []
        self._batch = None
        if not module.training:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if input_ids is None:
            return
        batch, seq = input_ids.shape
        self._batch = (batch, None if mask is None else mask[:, -seq:].to(torch.bool))

    def _record(self, gate: nn.Module, args: tuple, output: tuple) -> None:
        if self._batch is not None:  # only inside a training forward (not a checkpointing recompute)
            _, experts, logits = output
            self._records.append((gate, logits, experts, args[1] if len(args) > 1 else None))

    def _end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        records, batch = self._records, self._batch
        self._records, self._batch = [], None
        if batch is None or not records:
            return output
        batch_size, valid = batch
        losses = []
        for gate, logits, experts, image_mask in records:
            real = None
            if valid is not None and valid.numel() == experts.shape[0]:
                real = valid.reshape(-1)
            with torch.no_grad():
                self._count(gate, experts, image_mask, real)
            if self.balance_loss_weight:
                losses.append(sequence_balance_loss(logits, experts, batch_size, gate.scoring_func,
                                                    None if real is None else real.view(batch_size, -1)))
        if not losses:
            return output
        self.last_balance_loss = self.balance_loss_weight * torch.stack(losses).mean()
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.last_balance_loss.to(output.loss.dtype)
        return output

    def _count(self, gate: DeepseekV41Gate, experts: torch.Tensor, image_mask: torch.Tensor | None,
               real: torch.Tensor | None) -> None:
        n = gate.weight.shape[0]
        real = torch.ones(experts.shape[0], dtype=torch.bool, device=experts.device) if real is None else real
        image = torch.zeros_like(real) if image_mask is None or gate.bias_vl is None else image_mask.reshape(-1)
        self.text_counts[id(gate)] += expert_counts(experts, n, real & ~image).cpu()
        self.image_counts[id(gate)] += expert_counts(experts, n, real & image).cpu()

    @torch.no_grad()
    def update_biases(self) -> dict[str, float]:
        """Move every gate's `bias` by the text loads and `bias_vl` by the image loads collected since the last
        call (summed over processes when torch.distributed is initialised), then reset the loads. Returns the mean
        over gates of max load / mean load per modality (1.0 is perfect balance)."""
        text = [self.text_counts[id(g)] for g in self.gates]
        image = [self.image_counts[id(g)] for g in self.gates]
        if self.gates and torch.distributed.is_available() and torch.distributed.is_initialized():
            flat = torch.cat(text + image).to(self.gates[0].bias.device)
            torch.distributed.all_reduce(flat)
            parts = list(flat.cpu().split([len(t) for t in text + image]))
            text, image = parts[:len(text)], parts[len(text):]
        stats: dict[str, float] = {}
        for label, loads, attr in (("text", text, "bias"), ("image", image, "bias_vl")):
            ratios = []
            for gate, load in zip(self.gates, loads):
                bias = getattr(gate, attr)
                if bias is None or load.sum() == 0:
                    continue
                step = torch.sign(load.mean() - load) * self.update_speed
                bias.add_(step.to(bias.device, bias.dtype))
                ratios.append(float(load.max() / load.mean()))
            if ratios:
                stats[f"{label}_max_over_mean_load"] = sum(ratios) / len(ratios)
        for counts in (*self.text_counts.values(), *self.image_counts.values()):
            counts.zero_()
        self.last_stats = stats
        return stats


class ExpertBalanceCallback(TrainerCallback):
    """Trainer callback running an `ExpertBalancer`: hooks attached at train start, biases updated after every
    optimizer step, hooks removed at train end. `update_speed` 0.001 and `balance_loss_weight` 1e-4 by default."""

    def __init__(self, update_speed: float = 1e-3, balance_loss_weight: float = 1e-4) -> None:
        self.update_speed = update_speed
        self.balance_loss_weight = balance_loss_weight
        self.balancer: ExpertBalancer | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.balancer = ExpertBalancer(model, self.update_speed, self.balance_loss_weight).attach()

    def on_step_end(self, args, state, control, **kwargs):
        if self.balancer is not None:
            self.balancer.update_biases()

    def on_train_end(self, args, state, control, **kwargs):
        if self.balancer is not None:
            self.balancer.detach()
