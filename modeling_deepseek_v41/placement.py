"""What `from_pretrained` does beyond transformers' loader to place the model on several devices: the CSA2-aware
`device_map="auto"`, Engram tables attached from host memory or the checkpoint file, and tensor-parallel
parameters turned into plain per-rank tensors once loaded."""

from __future__ import annotations

import os
import re

import torch

from .device_map import (
    check_device_map, deepseek_device_map, preload_submodules, return_to_input_device, spread_units,
)
from .engram import DeepseekV41ExternalEngramTable
from .tensor_parallel import RemoteExpert, localize_parameters

_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_EXPERT_KEY = re.compile(r"^(.*\.experts\.\d+)\.")


def _local_folder(path, hub_kwargs: dict) -> str:
    """The local folder of a checkpoint (downloaded by transformers already when it came from the hub)."""
    if os.path.isdir(path):
        return str(path)
    from transformers.utils import cached_file

    for name in ("model.safetensors.index.json", "model.safetensors"):
        found = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if found is not None:
            return os.path.dirname(found)
    raise FileNotFoundError(f"No safetensors checkpoint found for {path}.")


def _meta_model(cls, path, kwargs: dict):
    """The model skeleton on the meta device, from the checkpoint's config and the call's config overrides."""
    config = kwargs.get("config")
    if config is None:
        config, _ = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **{
            k: v for k, v in kwargs.items() if k not in ("device_map", "max_memory", "offload_folder")})
    with torch.device("meta"):
        return cls(config)


class DeepseekV41PlacementMixin:
    """Mixed into the DeepSeek-V4.1 models ahead of `PreTrainedModel`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        device_map = kwargs.get("device_map")
        multi_gpu = torch.cuda.device_count() > 0
        if isinstance(device_map, str) and device_map in _AUTO_MAPS and multi_gpu:
            skeleton = _meta_model(cls, pretrained_model_name_or_path, kwargs)
            kwargs["device_map"] = deepseek_device_map(skeleton, kwargs.get("max_memory"))
        elif isinstance(device_map, dict) and len({d for d in device_map.values() if d not in ("cpu", "disk")}) > 1:
            check_device_map(_meta_model(cls, pretrained_model_name_or_path, kwargs), device_map)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        localize_parameters(model)
        model.attach_engram_tables(pretrained_model_name_or_path, {
            k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder") if k in kwargs})
        placed = set(getattr(model, "hf_device_map", {}).values())
        if len(placed) > 1 or "disk" in placed:
            return_to_input_device(model, spread_units(model))
            preload_submodules(model)
        return loaded

    def attach_engram_tables(self, pretrained_model_name_or_path, hub_kwargs: dict | None = None) -> None:
        """Open every host/mmap Engram table of this model from the checkpoint (no-op for device tables)."""
        from .engram_storage import ExternalTable

        tables = [(name, m) for name, m in self.named_modules() if isinstance(m, DeepseekV41ExternalEngramTable)]
        if not tables:
            return
        folder = _local_folder(pretrained_model_name_or_path, hub_kwargs or {})
        for name, table in tables:
            table.attach(ExternalTable.from_checkpoint(folder, name, table.quantized, table.storage))

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Checkpoint tensors that this rank or storage reads elsewhere are not "unexpected": the experts another
        tensor-parallel rank holds, and Engram tables kept in host memory or mapped from the file."""
        super()._adjust_missing_and_unexpected_keys(loading_info)
        elsewhere = {name for name, m in self.named_modules()
                     if isinstance(m, (RemoteExpert, DeepseekV41ExternalEngramTable))}
        if not elsewhere:
            return

        def read_elsewhere(key: str) -> bool:
            match = _EXPERT_KEY.match(key)
            return key.rpartition(".")[0] in elsewhere or (match is not None and match.group(1) in elsewhere)

        loading_info.unexpected_keys = {k for k in loading_info.unexpected_keys if not read_elsewhere(k)}

    def save_pretrained(self, *args, **kwargs):
        """Refuses what would write an incomplete checkpoint: a model with Engram tables off the device, or one
        whose tensor-parallel shards were turned into per-rank tensors."""
        if any(isinstance(m, DeepseekV41ExternalEngramTable) for m in self.modules()):
            raise ValueError("This model's Engram tables are not parameters (engram_storage='host'/'mmap'), so "
                             "save_pretrained would leave them out. Load it with engram_storage='device' to save.")
        if getattr(self, "_tp_localized", False):
            raise ValueError("This model was loaded tensor-parallel: each rank holds only its shards. Saving it is "
                             "not supported; load it on one process to save.")
        return super().save_pretrained(*args, **kwargs)
