"""Which update rule each parameter of a DeepSeek-V4.1 model gets (head-wise Muon, Sinkhorn, AdamW, or none)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

MUON = "muon"
SINKHORN = "sinkhorn"
ADAMW = "adamw"
ROUTER_BIAS = "router_bias"  # moved by the expert-balancing callback, not by the optimizer
FROZEN = "frozen"

ENGRAM_LR_SCALE = 5.0

_NO_DECAY_SUFFIXES = ("_base", "_scale", "attn_sink", "image_start", "image_end", "image_newline")


@dataclass(frozen=True)
class ParamRule:
    """The rule for one parameter: `kind` (one of MUON, SINKHORN, ADAMW, ROUTER_BIAS, FROZEN), whether AdamW
    decays it, the learning-rate multiplier, and for Muon the rows per orthogonalised block (None: the whole
    matrix is one block)."""

    kind: str
    decay: bool = False
    lr_scale: float = 1.0
    block_rows: int | None = None


def _owner(model: nn.Module, name: str, depth: int) -> nn.Module:
    return model.get_submodule(name.rsplit(".", depth)[0])


def _muon_block_rows(model: nn.Module, name: str) -> int | None:
    """Rows per block for the weights whose rows are several independent maps; None for the rest."""
    if name.endswith("attn.indexer.wq_b.weight"):  # one block per index query head
        return _owner(model, name, 2).head_dim
    if name.endswith("attn.wq_b.weight"):  # one block per attention query head
        return _owner(model, name, 2).head_dim
    if name.endswith("attn.wo_a.weight"):  # block-diagonal grouped output projection: one matrix per group
        return _owner(model, name, 2).o_lora_rank
    if name.endswith("attn.wqkv.weight"):  # vision: q, k and v of every head are separate maps
        return _owner(model, name, 2).head_dim
    return None


def rule_for(model: nn.Module, name: str, shape: tuple[int, ...], requires_grad: bool) -> ParamRule:
    """The rule for the parameter `name` (its checkpoint name; prefixes such as PEFT's are allowed)."""
    if not requires_grad:
        return ParamRule(ROUTER_BIAS if re.search(r"gate\.bias(_vl)?$", name) else FROZEN)
    if name.endswith("engram.embed.weight"):
        return ParamRule(SINKHORN, lr_scale=ENGRAM_LR_SCALE)
    if re.search(r"(^|\.)(embed|head|lm_head)\.weight$", name) and len(shape) == 2:
        # token embedding, output head, and the DSpark Markov head's vocabulary tables: rows are token identities
        return ParamRule(SINKHORN)
    if name.endswith(("engram.q_weight", "engram.k_weight")):  # per-stream gains, like norm weights
        return ParamRule(ADAMW, decay=True)
    if len(shape) == 2 and min(shape) > 1:
        return ParamRule(MUON, block_rows=_muon_block_rows(model, name))
    if len(shape) == 2 or re.search(r"norm\d*\.weight$", name):  # norm weights and single-row weight vectors
        return ParamRule(ADAMW, decay=True)
    if name.endswith(".bias") or name.endswith(_NO_DECAY_SUFFIXES):
        return ParamRule(ADAMW, decay=False)
    return ParamRule(ADAMW, decay=len(shape) > 1)


def parameter_rules(model: nn.Module) -> dict[str, ParamRule]:
    """Every named parameter of `model` (shared tensors once) mapped to its rule."""
    return {name: rule_for(model, name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()}
