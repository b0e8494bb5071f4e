"""Logical parameter counts by component (packed FP4 bytes count as two weights; scales are not weights)."""

from __future__ import annotations

import re

import torch
from torch import nn

from .loader import hub_name

COMPONENTS = {
    "routed_experts": re.compile(r"^layers\.\d+\.ffn\.experts\."),
    "shared_experts": re.compile(r"^layers\.\d+\.ffn\.shared_experts\."),
    "attention": re.compile(r"^layers\.\d+\.attn\."),
    "embed_and_head": re.compile(r"^(embed|head)\.weight$"),
    "engram_tables": re.compile(r"^layers\.\d+\.engram\.embed\.weight$"),
    "engram_projections": re.compile(r"^layers\.\d+\.engram\.(?!embed\.)"),
    "dspark": re.compile(r"^mtp\."),
    "vision_tower": re.compile(r"^vision\."),
    "vision_aligner": re.compile(r"^(aligner\.|image_(start|end|newline)$)"),
}


def component_of(name: str) -> str:
    """The parameter-count component of a tensor (module or hub name); a block scale belongs to its weight's."""
    weight_name = hub_name(re.sub(r"\.scale$", ".weight", name))
    return next((group for group, pattern in COMPONENTS.items() if pattern.search(weight_name)), "other")


def logical_parameters(model: nn.Module):
    """(name, tensor, weights it stands for) of every parameter but E8M0 scales (not weights): packed FP4 (int8
    storage) holds two weights per byte."""
    storage = {f"{name}.weight": module.storage for name, module in model.named_modules() if hasattr(module, "storage")}
    for name, tensor in model.named_parameters():
        if name.endswith(".scale") and tensor.dtype == torch.float8_e8m0fnu:
            continue
        yield name, tensor, tensor.numel() * (2 if storage.get(name) == "fp4" else 1)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Per-component logical parameter counts, plus `other` (norms, hc mixes, gates...) and `backbone`
    (everything but the Engram tables, the DSpark drafter and the vision side). Works on the meta device."""
    counts = dict.fromkeys(list(COMPONENTS) + ["other"], 0)
    for name, _, n in logical_parameters(model):
        counts[component_of(name)] += n
    excluded = ("engram_tables", "dspark", "vision_tower", "vision_aligner")
    counts["backbone"] = sum(v for k, v in counts.items() if k not in excluded)
    counts["total"] = sum(v for k, v in counts.items() if k != "backbone")
    return counts


def logical_num_parameters(model: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """`PreTrainedModel.num_parameters` in weights rather than stored elements: packed FP4 bytes count two, E8M0
    scales none (a quantized model and its bf16 weight mode give the same count; stored bytes:
    `get_memory_footprint()`)."""
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    return sum(n for name, tensor, n in logical_parameters(model)
               if not (only_trainable and not tensor.requires_grad) and not (exclude_embeddings and name in embeddings))
