"""What the converters need to know about the two layouts: which weights are quantized and how, the configs of
each layout, the source checks, and the non-weight files that travel with the weights.

- hub layout: the released checkpoint as shipped (FP8/FP4 weights with `.scale`, fp32-held tensors stored bf16,
  no `engram_token_map`), config.json with `quantization_config`.
- native layout: what `DeepseekV41ForCausalLM.save_pretrained` writes (the names of the model's state dict,
  `model.layers.3.attn.wq_a.weight` and `lm_head.weight`; every tensor in the dtype the model holds it,
  `model.engram_token_map` included), either dense bf16 (`weight_mode` "bf16") or with the FP8/FP4 bytes kept.
  Native folders of earlier releases, with the hub's names, are read too.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from modeling_deepseek_v41.loading.checkpoint_layout import checkpoint_files
from modeling_deepseek_v41.loading.safetensors_file import SafetensorsEntry, safetensors_entries
from modeling_deepseek_v41.model.checkpoint import validate_checkpoint_folder


HUB_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                           "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
KIND_FP8_TILE = "fp8_tile"  # e4m3 [N, K] + E8M0 [ceil(N/32), ceil(K/32)]
KIND_FP4 = "fp4"  # packed e2m1 int8 [N, K/2] + E8M0 [N, K/32]
KIND_FP8_ROWS = "fp8_rows"  # Engram tables: e4m3 [rows, d] + E8M0 [rows, d/32]
SIDECAR_PREFIX = "hub_scales"  # bf16 native folders keep the hub's scales here, for a bit-exact way back
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")


class CheckpointError(ValueError):
    """The source checkpoint is incomplete or does not match its config."""


def load_config(folder: str | Path):
    """The folder's DeepseekV41Config (a clear error if config.json is missing or invalid)."""
    from modeling_deepseek_v41 import DeepseekV41Config

    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json.")
    try:
        return DeepseekV41Config.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{path} is not a valid DeepSeek-V4.1 config: {error}") from error


def with_weight_mode(config, weight_mode: str):
    """A copy of `config` for the hub's quantized storage ("quantized") or dense weights ("bf16")."""
    config = copy.deepcopy(config)
    config.checkpoint_quantization = dict(HUB_QUANTIZATION_CONFIG) if weight_mode == "quantized" else None
    config.weight_mode = weight_mode
    config.architectures = ["DeepseekV41ForCausalLM"]
    return config


def quantized_weight_kinds(config) -> dict[str, str]:
    """weight name -> KIND_* for every weight the hub stores quantized (its scale is `scale_name(name)`)."""
    from modeling_deepseek_v41.kernels.linear import STORAGE_FP4, STORAGE_FP8
    from modeling_deepseek_v41.layers.engram import DeepseekV41EngramTable
    from modeling_deepseek_v41.layers.linear import DeepseekV41Weight
    from modeling_deepseek_v41.loading.loader import hub_name
    from modeling_deepseek_v41.model.causal_lm import DeepseekV41ForCausalLM

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(with_weight_mode(config, "quantized"))
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(module, DeepseekV41Weight) and module.storage in (STORAGE_FP8, STORAGE_FP4):
            kinds[hub_name(f"{name}.weight")] = KIND_FP8_TILE if module.storage == STORAGE_FP8 else KIND_FP4
        elif isinstance(module, DeepseekV41EngramTable) and module.quantized:
            kinds[hub_name(f"{name}.weight")] = KIND_FP8_ROWS
    return kinds


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale`."""
    return weight_name[: -len("weight")] + "scale"


def inspect_source(folder: str | Path, config, hub_layout: bool) -> dict[str, SafetensorsEntry]:
    """Check the folder against `config` from the headers alone (missing shard, truncated shard, missing / extra /
    mis-shaped tensors, index entries that point at the wrong shard) and locate every tensor's bytes."""
    folder = Path(folder)
    try:
        validate_checkpoint_folder(folder, config, hub_layout=hub_layout)
        files = checkpoint_files(folder)
    except (ValueError, OSError) as error:
        raise CheckpointError(str(error)) from error
    sources: dict[str, SafetensorsEntry] = {}
    for path in files:
        for name, source in safetensors_entries(path).items():
            if name in sources:
                raise CheckpointError(f"tensor {name} is stored twice: in {sources[name].path.name} and {path.name}")
            sources[name] = source
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        wrong = [f"{n} (index: {f}, found in {sources[n].path.name if n in sources else 'no shard'})"
                 for n, f in weight_map.items() if n not in sources or sources[n].path.name != f]
        unlisted = [n for n in sources if n not in weight_map]
        if wrong or unlisted:
            raise CheckpointError(f"{index_path.name} disagrees with the shards: " + ", ".join((wrong + unlisted)[:20]))
    return sources


def source_files(sources: dict[str, SafetensorsEntry]) -> list[Path]:
    """The distinct files, in order of first appearance."""
    return list(dict.fromkeys(s.path for s in sources.values()))


def copy_auxiliary_files(src: Path, dst: Path) -> None:
    """Copy tokenizer, chat template, processor, generation config and any other non-weight files (and folders)."""
    skip = {p for pattern in WEIGHT_FILES for p in src.glob(pattern)}
    skip |= set(src.glob(f"{SIDECAR_PREFIX}*"))
    for path in sorted(src.iterdir()):
        if path in skip or path.name.startswith("."):
            continue
        target = dst / path.name
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)


def write_native_config(folder: Path, config) -> None:
    """config.json as save_pretrained writes it."""
    config.save_pretrained(str(folder))


def write_hub_config(folder: Path, config) -> None:
    """config.json in the hub's wrapper form: text_config, vision_config (or null), image_token_id and the
    quantization_config; the in-memory `weight_mode` choice is not part of the hub file."""
    data = config.to_diff_dict()
    data.pop("weight_mode", None)
    data.pop("transformers_version", None)
    data["architectures"] = ["DeepseekV41ForCausalLM"]
    data["quantization_config"] = dict(HUB_QUANTIZATION_CONFIG)
    data["text_config"] = config.text_config.to_diff_dict()
    data["vision_config"] = config.vision_config.to_diff_dict() if config.vision_config is not None else None
    for sub in (data["text_config"], data["vision_config"]):
        if sub is not None:
            sub.pop("transformers_version", None)
    ordered = {key: data.pop(key) for key in ("architectures", "model_type") if key in data}
    ordered.update(data)
    (folder / "config.json").write_text(json.dumps(ordered, indent=2, sort_keys=False) + "\n")
