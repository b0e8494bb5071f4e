"""What the model's transformers hooks and its tools need around a checkpoint: the hub's tensor names and their
mapping, the tensors a built model reads (the checkpoint check before any weight is read, the keys it reads
elsewhere), what save_pretrained refuses, the Engram token map from a tokenizer, and the dequantization to bf16.
The ordered steps of `from_pretrained` are in `pipeline.py`."""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from ..layers.engram import DeepseekV41ExternalEngramTable
from ..layers.engram_hashing import build_compressed_token_map
from .checkpoint_layout import check_checkpoint_folder, saved_with_module_names
from .tensor_parallel import RemoteExpert

# The hub checkpoint's flat names (`embed.weight`, `layers.N...`, `head.weight`, `mtp.N...`) are kept on disk; in
# DeepseekV41ForCausalLM the base model's tensors live under `model.` and the head is `lm_head`.
_BASE_MODEL_TENSORS = r"(embed|layers|norm|mtp|vision|aligner|image_start|image_end|image_newline|engram_token_map)"
HUB_RENAMES = ((rf"^{_BASE_MODEL_TENSORS}", r"^model.\1"), (r"^head\.", r"^lm_head."))


def register_hub_names(class_name: str) -> None:
    """Register the hub-name renaming as transformers' checkpoint conversion mapping of `class_name`: applied by
    from_pretrained, reversed by save_pretrained."""
    mapping = [WeightRenaming(source, target) for source, target in HUB_RENAMES]
    register_checkpoint_conversion_mapping(class_name, mapping, overwrite=True)


def hub_name(name: str) -> str:
    """The hub checkpoint's name of a tensor of DeepseekV41ForCausalLM's state dict (the mapping's inverse)."""
    if name.startswith("lm_head."):
        return "head." + name[len("lm_head."):]
    return name.removeprefix("model.")


def module_name(name: str) -> str:
    """DeepseekV41ForCausalLM's state-dict name of a tensor named as on the hub (module names are kept)."""
    return re.sub(r"^head\.", "lm_head.", re.sub(rf"^{_BASE_MODEL_TENSORS}(?=\.|$)", r"model.\1", name))


def accept_hub_names(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of DeepseekV41ForCausalLM: a state dict in the hub's names (the released files,
    `save_pretrained(save_original_format=True)`, checkpoints of earlier releases) loads under the module names."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        renamed = prefix + module_name(key[len(prefix):])
        if renamed != key:
            state_dict[renamed] = state_dict.pop(key)


_EXPERT_KEY = re.compile(r"^(.*\.experts\.\d+)\.")


def held_tensors(model: nn.Module, rename=hub_name) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor the model reads from a checkpoint, including Engram tables kept off
    the device (which are not parameters) and the routed experts other tensor-parallel ranks hold. Names are the
    hub's by default (`rename=hub_name`)."""
    held = {rename(name): (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, DeepseekV41ExternalEngramTable):
            held.update({rename(f"{name}.{key}"): value for key, value in module.checkpoint_tensors().items()})
        elif isinstance(module, RemoteExpert):  # held by another rank: shaped like the experts held here
            sibling = next(m for m in modules[name.rpartition(".")[0]] if not isinstance(m, RemoteExpert))
            held.update({rename(f"{name}.{key}"): (tuple(t.shape), t.dtype)
                         for key, t in sibling.state_dict().items()})
    return held


def check_checkpoint(model: nn.Module, folder, ignore_mismatched_sizes: bool) -> None:
    """Check a local checkpoint folder against the built full model (on the meta device), before any weight is read.
    The base model alone loads from a full checkpoint and leaves the head unused: transformers reports that."""
    if model.get_output_embeddings() is None:
        return
    if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder) and not ignore_mismatched_sizes:
        mapped = saved_with_module_names(folder)  # nothing to map back
        rename = (lambda name: name) if mapped else hub_name
        held = held_tensors(model, rename)
        if _saved_base_model(folder):  # a DeepseekV41Model save has no head: transformers initialises and reports it
            held.pop(rename("lm_head.weight"), None)
        check_checkpoint_folder(folder, held, hub_layout=False if mapped else None)


def _saved_base_model(folder) -> bool:
    """Whether the folder's config says it holds the base model alone (`DeepseekV41Model.save_pretrained`)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as handle:
        return json.load(handle).get("architectures") == ["DeepseekV41Model"]


def read_elsewhere(model: nn.Module, keys: set[str]) -> set[str]:
    """The checkpoint keys this model reads elsewhere (not "unexpected"): the experts another tensor-parallel rank
    holds, and Engram tables kept in host memory or mapped from the file."""
    elsewhere = {name for name, m in model.named_modules()
                 if isinstance(m, (RemoteExpert, DeepseekV41ExternalEngramTable))}
    if not elsewhere:
        return set()

    def is_elsewhere(key: str) -> bool:
        match = _EXPERT_KEY.match(key)
        return key.rpartition(".")[0] in elsewhere or (match is not None and match.group(1) in elsewhere)

    return {k for k in keys if is_elsewhere(k)}


def check_savable(model: nn.Module) -> None:
    """Refuse what would write an incomplete checkpoint: Engram tables off the device, or tensor-parallel shards
    turned into per-rank tensors."""
    if any(isinstance(m, DeepseekV41ExternalEngramTable) for m in model.modules()):
        raise ValueError("This model's Engram tables are not parameters (engram_storage='host'/'mmap'), so "
                         "save_pretrained would leave them out. Load it with engram_storage='device' to save.")
    if getattr(model, "_tp_localized", False):
        raise ValueError("This model was loaded tensor-parallel: each rank holds only its shards. Saving it is "
                         "not supported; load it on one process to save.")


def load_tokenizer_for_token_map(pretrained_model_name_or_path: str | os.PathLike, **hub_kwargs):
    """The checkpoint folder's tokenizer; a clear error when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"The checkpoint at {pretrained_model_name_or_path} carries no Engram token map (engram_token_map), so "
            "it must be built from the checkpoint's tokenizer, but no tokenizer could be loaded from there "
            f"({error}). Put tokenizer.json and tokenizer_config.json next to the weights, or load the tokenizer "
            "yourself and call model.build_engram_token_map(tokenizer)."
        ) from error


def compressed_token_map(tokenizer, vocab_size: int, expected_size: int) -> torch.Tensor:
    """The Engram token map as an int64 tensor [vocab_size], checked against the config's compressed size."""
    mapping, size = build_compressed_token_map(tokenizer)
    if size != expected_size:
        raise ValueError(
            f"The tokenizer compresses to {size} Engram ids but the config's engram_compressed_vocab_size is "
            f"{expected_size}: every hash multiplier depends on it, so this tokenizer does not belong to this model."
        )
    if len(mapping) > vocab_size:
        raise ValueError(f"The tokenizer has {len(mapping)} tokens but the model's vocab_size is {vocab_size}.")
    token_map = torch.zeros(vocab_size, dtype=torch.int64)
    token_map[: len(mapping)] = torch.tensor(mapping, dtype=torch.int64)
    return token_map


def dequantize_module_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Turn every FP8/FP4 weight (and Engram table) into a dense weight of `dtype`, module by module."""
    for module in model.modules():
        dequantize = getattr(module, "dequantize_", None)
        if dequantize is not None:
            dequantize(dtype)
