"""What `from_pretrained` does beyond transformers' loader, as functions on the model being loaded: the
CSA2-aware device map, the checkpoint check from the tensors the built model holds, Engram tables attached from
host memory or the checkpoint file, tensor-parallel parameters made per-rank, the Engram token map built from the
folder's tokenizer, and the optional dequantization to bf16."""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.utils import logging

from ..layers.engram import DeepseekV41ExternalEngramTable
from ..layers.engram_hashing import build_compressed_token_map
from .checkpoint_layout import check_checkpoint_folder, checkpoint_has_prefix, saved_with_module_names
from .device_map import check_device_map, deepseek_device_map, preload_submodules, return_to_input_device, spread_units
from .engram_storage import ExternalTable
from .tensor_parallel import RemoteExpert

logger = logging.get_logger(__name__)

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


HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_EXPERT_KEY = re.compile(r"^(.*\.experts\.\d+)\.")


def hub_kwargs_of(kwargs: dict) -> dict:
    """The download arguments of a from_pretrained call (for the tokenizer and the Engram table files)."""
    return {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}


def local_folder(path, hub_kwargs: dict) -> str:
    """The local folder of a checkpoint (downloaded by transformers already when it came from the hub)."""
    if os.path.isdir(path):
        return os.path.join(path, hub_kwargs.get("subfolder") or "")
    from transformers.utils import cached_file

    for name in ("model.safetensors.index.json", "model.safetensors"):
        found = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if found is not None:
            return os.path.dirname(found)
    raise FileNotFoundError(f"No safetensors checkpoint found for {path}.")


def multi_device_map(device_map) -> str:
    """How a device_map argument places the model: "auto" (ours, on CUDA), "explicit" over several devices, or ""."""
    if isinstance(device_map, str) and device_map in _AUTO_MAPS and torch.cuda.device_count() > 0:
        return "auto"
    if isinstance(device_map, dict) and len({d for d in device_map.values() if d not in ("cpu", "disk")}) > 1:
        return "explicit"
    return ""


def place_skeleton(skeleton: nn.Module, device_map, max_memory: dict | None):
    """The device map to load with, from a meta-device skeleton: the CSA2-aware map for "auto", or the given map
    after checking that it keeps each layer's attention side on one device."""
    if multi_device_map(device_map) == "auto":
        return deepseek_device_map(skeleton, max_memory)
    check_device_map(skeleton, device_map)
    return device_map


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


def attach_engram_tables(model: nn.Module, pretrained_model_name_or_path, hub_kwargs: dict) -> None:
    """Open every host/mmap Engram table of `model` from the checkpoint (no-op for device tables)."""
    tables = [(name, m) for name, m in model.named_modules() if isinstance(m, DeepseekV41ExternalEngramTable)]
    if not tables:
        return
    folder = local_folder(pretrained_model_name_or_path, hub_kwargs)
    module_names = saved_with_module_names(folder)
    for name, table in tables:
        full = name if model.base_model is not model else f"{model.base_model_prefix}.{name}"
        stored = full if module_names else hub_name(full)
        table.attach(ExternalTable.from_checkpoint(folder, stored, table.quantized, table.storage))


def spread_over_devices(model: nn.Module) -> None:
    """After a multi-device load: the layers' outputs return to the input's device and offloaded units preload."""
    placed = set(getattr(model, "hf_device_map", {}).values())
    if len(placed) > 1 or "disk" in placed:
        return_to_input_device(model, spread_units(model))
        preload_submodules(model)


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


def token_map_not_loaded(model: nn.Module, pretrained_model_name_or_path, state_dict: dict | None,
                         hub_kwargs: dict) -> bool:
    """Whether `model` has Engram layers and the checkpoint it was loaded from holds no Engram token map (the hub
    layout, as released), so that the map must be built from the checkpoint's tokenizer. Weights given as a
    state_dict without a map keep the default one, with a warning."""
    if not hasattr(model.base_model, "engram_token_map"):
        return False
    if pretrained_model_name_or_path is None:
        if state_dict is not None and not any(key.endswith("engram_token_map") for key in state_dict):
            logger.warning(
                "The given state_dict has no engram_token_map: the model keeps the default Engram token map (token "
                "id modulo engram_compressed_vocab_size). Weights trained with a tokenizer need its map: call "
                "model.build_engram_token_map(tokenizer)."
            )
        return False
    folder = local_folder(pretrained_model_name_or_path, hub_kwargs)
    return not checkpoint_has_prefix(folder, ("engram_token_map", "model.engram_token_map"))


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
