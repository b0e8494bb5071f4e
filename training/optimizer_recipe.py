"""The DeepSeek-V4.1 optimizer recipe: parameter groups and one optimizer that applies each group's rule.

- head-wise Muon for 2-D projections (query heads, index query heads and output groups orthogonalised per block),
- the Sinkhorn-balanced update for the token embedding, the output head and the Engram tables (Engram lr x5),
- AdamW for norms, biases, scales and other vectors.

Use `create_optimizer(model, training_args)` with `Trainer(optimizers=(optimizer, None))`, or `DeepseekV41Trainer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .muon import closure_loss, muon_step
from .parameter_rules import ADAMW, MUON, SINKHORN, parameter_rules
from .sinkhorn_update import sinkhorn_step


@dataclass
class RecipeHyperparameters:
    """The recipe's constants (the paper's values); the learning rate comes from the caller."""

    weight_decay: float = 0.1
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_update_rms: float = 0.18
    sinkhorn_beta: float = 0.95
    sinkhorn_nesterov: bool = True
    sinkhorn_gamma: float = 0.18
    sinkhorn_iterations: int = 11
    sinkhorn_tau: float = 1e-3
    sinkhorn_eps: float = 1e-20
    engram_lr_scale: float = 5.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-20


def build_param_groups(model: nn.Module, lr: float, hp: RecipeHyperparameters | None = None
                       ) -> list[dict[str, Any]]:
    """Parameter groups for `DeepseekV41Optimizer`: one group per (rule, lr multiplier, decay, block size), each
    with a `rule` key and the rule's hyper-parameters. Only trainable parameters are included; router biases and
    frozen tensors are reported by `parameter_rules` and left to the balancing callback / nobody."""
    hp = hp or RecipeHyperparameters()
    params = dict(model.named_parameters())
    groups: dict[tuple, dict[str, Any]] = {}
    for name, rule in parameter_rules(model).items():
        if rule.kind not in (MUON, SINKHORN, ADAMW):
            continue
        lr_scale = hp.engram_lr_scale if rule.kind == SINKHORN and rule.lr_scale != 1.0 else rule.lr_scale
        key = (rule.kind, lr_scale, rule.decay, rule.block_rows)
        if key not in groups:
            group: dict[str, Any] = {"params": [], "names": [], "rule": rule.kind, "lr": lr * lr_scale}
            if rule.kind == MUON:
                group.update(weight_decay=hp.weight_decay, momentum=hp.muon_momentum, nesterov=hp.muon_nesterov,
                             update_rms=hp.muon_update_rms, block_rows=rule.block_rows)
            elif rule.kind == SINKHORN:
                group.update(weight_decay=0.0, beta=hp.sinkhorn_beta, nesterov=hp.sinkhorn_nesterov,
                             gamma=hp.sinkhorn_gamma, iterations=hp.sinkhorn_iterations, tau=hp.sinkhorn_tau,
                             eps=hp.sinkhorn_eps)
            else:
                group.update(weight_decay=hp.weight_decay if rule.decay else 0.0,
                             betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps)
            groups[key] = group
        groups[key]["params"].append(params[name])
        groups[key]["names"].append(name)
    # the plain Muon group first: Trainer logs the first group's learning rate
    return sorted(groups.values(), key=lambda g: (g["rule"] != MUON, g.get("block_rows") is not None, g["lr"]))


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], *, lr: float, weight_decay: float,
               betas: tuple[float, float], eps: float) -> None:
    """AdamW with decoupled weight decay; moments in fp32."""
    if grad.is_sparse:
        raise RuntimeError("The AdamW rule needs dense gradients.")
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
    state["step"] += 1
    beta1, beta2 = betas
    g = grad.float()
    state["exp_avg"].lerp_(g, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt_().add_(eps)
    update = state["exp_avg"] / denom
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(update.to(param.dtype), alpha=-lr / (1 - beta1 ** state["step"]))


class DeepseekV41Optimizer(Optimizer):
    """One optimizer for the whole recipe: every param group has a `rule` ("muon", "sinkhorn" or "adamw") and that
    rule's hyper-parameters (see `build_param_groups`). LR schedulers scale every group's `lr` alike, so the
    Engram groups keep their x5 multiplier."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        groups = list(param_groups)
        for group in groups:
            if group.get("rule") not in (MUON, SINKHORN, ADAMW):
                raise ValueError("Every param group needs rule 'muon', 'sinkhorn' or 'adamw', "
                                 f"got {group.get('rule')!r}.")
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch's signature
        """One update of every parameter that has a gradient, by its group's rule."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["rule"] == MUON:
                    muon_step(p, p.grad, state, lr=group["lr"], weight_decay=group["weight_decay"],
                              momentum=group["momentum"], nesterov=group["nesterov"],
                              update_rms=group["update_rms"], block_rows=group["block_rows"])
                elif group["rule"] == SINKHORN:
                    sinkhorn_step(p, p.grad, state, lr=group["lr"], beta=group["beta"], nesterov=group["nesterov"],
                                  gamma=group["gamma"], iterations=group["iterations"], tau=group["tau"],
                                  eps=group["eps"])
                else:
                    adamw_step(p, p.grad, state, lr=group["lr"], weight_decay=group["weight_decay"],
                               betas=group["betas"], eps=group["eps"])
        return loss


def create_optimizer(model: nn.Module, args: Any = None, lr: float | None = None,
                     **overrides: Any) -> DeepseekV41Optimizer:
    """The recipe's optimizer for `model`. The learning rate is `lr`, else `args.learning_rate` (a
    `TrainingArguments`); the other constants are the recipe's (`RecipeHyperparameters`), changed by keyword
    (`create_optimizer(model, args, weight_decay=0.05)`). TrainingArguments' adam_* and weight_decay are not read."""
    if lr is None:
        if args is None:
            raise ValueError("create_optimizer needs lr= or TrainingArguments with learning_rate.")
        lr = args.learning_rate
    hp = RecipeHyperparameters(**{**asdict(RecipeHyperparameters()), **overrides})
    return DeepseekV41Optimizer(build_param_groups(model, lr, hp))


class RecipeOptimizerFactory:
    """The recipe as a Trainer option: `Trainer(..., optimizer_cls_and_kwargs=(RecipeOptimizerFactory,
    {"lr": 3e-4}))`. Trainer calls the factory with the model and these keyword arguments (`create_optimizer`'s)."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> DeepseekV41Optimizer:
        return create_optimizer(model, **kwargs)
