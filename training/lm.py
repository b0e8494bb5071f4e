"""Language-model fine-tuning: a `Trainer` with an optional MoE load-balancing auxiliary loss."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import Trainer

from modeling_deepseek_v41.layers.moe import gate_scores


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The gate's affinity scores from its logits (the same function the router uses), normalised per token."""
    scores = gate_scores(logits.float(), scoring_func)
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)


def moe_balance_loss(router_logits, router_experts, n_experts: int, scoring_func: str = "sqrtsoftplus",
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style balance loss averaged over layers: n_experts * sum_e f_e * P_e, where f_e is the share of
    routing slots that chose expert e and P_e the mean normalised score of e over the (non-padding) tokens.
    Equals 1 for perfectly uniform routing. `router_logits` / `router_experts` are the model outputs of a forward
    with output_router_logits=True ([T,E] and [T,k] per layer)."""
    keep = None if attention_mask is None else attention_mask.reshape(-1).to(torch.bool)
    losses = []
    for logits, experts in zip(router_logits, router_experts):
        probs = router_scores(logits, scoring_func)
        chosen = F.one_hot(experts, n_experts).sum(1).float()  # [T,E]
        if keep is not None:
            probs, chosen = probs[keep], chosen[keep]
        if probs.shape[0] == 0:
            continue
        share = chosen.sum(0) / chosen.sum().clamp_min(1.0)
        losses.append(n_experts * (share * probs.mean(0)).sum())
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).mean()


class DeepseekV41Trainer(Trainer):
    """`Trainer` for DeepSeek-V4.1 causal-LM fine-tuning (full or PEFT). With `moe_aux_loss_coef` > 0 the loss
    adds coef x `moe_balance_loss` over the backbone's MoE layers (the gate weights get its gradient; the
    routing biases stay as they are)."""

    def __init__(self, *args, moe_aux_loss_coef: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moe_aux_loss_coef = moe_aux_loss_coef

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.moe_aux_loss_coef <= 0:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs, output_router_logits=True)
        text = _text_config(model)
        aux = moe_balance_loss(outputs.router_logits, outputs.router_experts, text.n_routed_experts,
                               text.scoring_func, inputs.get("attention_mask"))
        loss = outputs.loss + self.moe_aux_loss_coef * aux.to(outputs.loss.device)
        return (loss, outputs) if return_outputs else loss


def _text_config(model):
    config = getattr(model, "config", None)
    while config is None or not hasattr(config, "text_config"):
        model = getattr(model, "module", None) or getattr(model, "base_model", None) or model.model
        config = getattr(model, "config", None)
    return config.text_config
