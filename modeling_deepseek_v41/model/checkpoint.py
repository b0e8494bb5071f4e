"""The checkpoint a configuration describes, for tools (converters, the random-checkpoint maker, tests): the
tensors it stores and checking a folder against it. `from_pretrained` checks against the model it builds instead."""

from __future__ import annotations

import os

import torch

from ..config.configuration_deepseek_v41 import config_with_device_engram
from ..loading.checkpoint_layout import check_checkpoint_folder, saved_with_module_names, stored_tensors
from ..loading.loader import held_tensors, hub_name
from .causal_lm import DeepseekV41ForCausalLM


def config_tensors(config, module_names: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor a model of `config` holds, built on the meta device (no memory): the
    hub's names, or with `module_names` the names of DeepseekV41ForCausalLM's state dict (what save_pretrained
    writes)."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config_with_device_engram(config))  # host/mmap tables are stored too
    return held_tensors(model, (lambda name: name) if module_names else hub_name)


def expected_tensors(config, hub_layout: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, stored dtype) of the checkpoint of a model of `config`: the hub's layout by default, else
    the native layout save_pretrained writes (module names, the dtypes the model holds, the Engram token map)."""
    return stored_tensors(config_tensors(config, module_names=not hub_layout), hub_layout=hub_layout)


def validate_checkpoint_folder(folder: str | os.PathLike, config, hub_layout: bool | None = None) -> dict:
    """Check a local checkpoint folder against `config` from its headers alone; raise naming every problem.
    Tensors named as on the hub or as in the model's state dict are both recognised. Returns the per-pattern
    tensor counts found."""
    if saved_with_module_names(folder):
        return check_checkpoint_folder(folder, config_tensors(config, module_names=True), hub_layout=False)
    return check_checkpoint_folder(folder, config_tensors(config), hub_layout=hub_layout)
