"""`from_pretrained` as one ordered pipeline: `STEPS`, each a named function of the `LoadRequest`, run in order.

 1. check_folder              a local path must be a checkpoint folder (a file or a missing folder is named so)
 2. drop_absent_drafter       a folder without DSpark drafter weights (mtp.*) loads without the drafter
 3. place_on_devices          a multi-device device_map: the CSA2-aware map from a meta skeleton, or the given one
                              checked
 4. prepare_tensor_parallel   a tp_plan: this model's parallel styles registered with transformers
 5. load_weights              transformers' loader builds the model and reads the weights; it calls the model's two
                              hooks back: the checkpoint checked against the built model from its headers before
                              any weight is read (`loader.check_checkpoint`), and the keys read elsewhere than
                              from parameters (`loader.read_elsewhere`)
 6. localize_tensor_parallel  the DTensor parameters become this rank's plain tensors
 7. attach_engram_tables      Engram tables kept in host memory or mapped are opened from the checkpoint's files
 8. spread_over_devices       after a multi-device load: outputs return to the input's device, offloaded units
                              preload their submodules
 9. build_token_map           the Engram token map from the folder's tokenizer, when the weights do not carry it
10. dequantize_or_cast        weight_mode="bf16" dequantizes; dtype= casts, or is refused with the reason
11. check_finite              no NaN/Inf in the loaded weights and scales (unless check_finite=False)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

from ..config.configuration_deepseek_v41 import DeepseekV41Config, config_without_dspark
from ..layers.engram import DeepseekV41ExternalEngramTable
from .checkpoint_layout import check_checkpoint_path, checkpoint_has_prefix, holds_drafter, saved_with_module_names
from .device_map import multi_device_map, preload_submodules, resolve_device_map, return_to_input_device, spread_units
from .engram_storage import ExternalTable
from .loader import hub_name, load_tokenizer_for_token_map
from .tensor_parallel import localize_parameters, register_parallel_styles, tensor_parallel_requested
from .weight_checks import check_finite_weights
from .weight_mode import apply_weight_mode

logger = logging.get_logger(__name__)

HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")
SKELETON_SKIPS = ("device_map", "max_memory", "offload_folder")  # placement arguments the config does not take


@dataclass
class LoadRequest:
    """One from_pretrained call as the steps see it. The steps before `load_weights` may rewrite `kwargs` (the
    config, the device map) that transformers' loader then receives; the steps after it work on `model`."""

    model_class: type
    path: str | os.PathLike | None
    model_args: tuple
    kwargs: dict
    transformers_load: Callable  # transformers' from_pretrained, bound to model_class
    check_finite: bool = True
    tensor_parallel: bool = False  # set by prepare_tensor_parallel
    loaded: object = field(default=None, repr=False)  # what transformers returned: the model, or (model, info)

    @property
    def model(self) -> nn.Module:
        return self.loaded[0] if isinstance(self.loaded, tuple) else self.loaded

    @property
    def hub_kwargs(self) -> dict:
        """The download arguments of the call (for the tokenizer and the Engram table files)."""
        return {k: self.kwargs[k] for k in HUB_KWARGS if k in self.kwargs}

    def local_folder(self) -> str:
        """The checkpoint's local folder (downloaded by transformers already when it came from the hub)."""
        if os.path.isdir(self.path):
            return os.path.join(self.path, self.hub_kwargs.get("subfolder") or "")
        from transformers.utils import cached_file

        for name in ("model.safetensors.index.json", "model.safetensors"):
            found = cached_file(self.path, name, _raise_exceptions_for_missing_entries=False, **self.hub_kwargs)
            if found is not None:
                return os.path.dirname(found)
        raise FileNotFoundError(f"No safetensors checkpoint found for {self.path}.")


def check_folder(request: LoadRequest) -> None:
    check_checkpoint_path(request.path)


def drop_absent_drafter(request: LoadRequest) -> None:
    """A checkpoint shipped without the drafter loads without it, rather than with random draft weights."""
    path, kwargs = request.path, request.kwargs
    if path is None or not os.path.isdir(path) or kwargs.get("ignore_mismatched_sizes") or holds_drafter(path):
        return
    config = kwargs.get("config")
    if not isinstance(config, DeepseekV41Config):
        config = request.model_class.config_class.from_pretrained(path, **request.hub_kwargs)
    if config.text_config.num_nextn_predict_layers:
        logger.warning("The checkpoint has no DSpark drafter weights (mtp.*): loading without the drafter.")
        kwargs["config"] = config_without_dspark(config)


def place_on_devices(request: LoadRequest) -> None:
    """The device map is computed from the module sizes: a skeleton on the meta device, before loading."""
    kwargs = request.kwargs
    if multi_device_map(kwargs.get("device_map")):
        skeleton = meta_skeleton(request)
        kwargs["device_map"] = resolve_device_map(skeleton, kwargs["device_map"], kwargs.get("max_memory"))


def meta_skeleton(request: LoadRequest) -> nn.Module:
    """The model on the meta device, from the checkpoint's config and the call's config overrides."""
    config = request.kwargs.get("config")
    if config is None:
        overrides = {k: v for k, v in request.kwargs.items() if k not in SKELETON_SKIPS}
        config, _ = request.model_class.config_class.from_pretrained(request.path, return_unused_kwargs=True,
                                                                     **overrides)
    with torch.device("meta"):
        return request.model_class(config)


def prepare_tensor_parallel(request: LoadRequest) -> None:
    request.tensor_parallel = tensor_parallel_requested(request.kwargs)
    if request.tensor_parallel:
        register_parallel_styles()


def load_weights(request: LoadRequest) -> None:
    request.loaded = request.transformers_load(request.path, *request.model_args, **request.kwargs)


def localize_tensor_parallel(request: LoadRequest) -> None:
    if request.tensor_parallel:
        localize_parameters(request.model)


def attach_engram_tables(request: LoadRequest) -> None:
    """Open every host/mmap Engram table of the model from the checkpoint (device tables were loaded as weights)."""
    model = request.model
    tables = [(name, m) for name, m in model.named_modules() if isinstance(m, DeepseekV41ExternalEngramTable)]
    if not tables:
        return
    folder = request.local_folder()
    module_names = saved_with_module_names(folder)
    for name, table in tables:
        full = name if model.base_model is not model else f"{model.base_model_prefix}.{name}"
        stored = full if module_names else hub_name(full)
        table.attach(ExternalTable.from_checkpoint(folder, stored, table.quantized, table.storage))


def spread_over_devices(request: LoadRequest) -> None:
    model = request.model
    placed = set(getattr(model, "hf_device_map", {}).values())
    if len(placed) > 1 or "disk" in placed:
        return_to_input_device(model, spread_units(model))
        preload_submodules(model)


def build_token_map(request: LoadRequest) -> None:
    if token_map_not_loaded(request):
        tokenizer = load_tokenizer_for_token_map(request.path, **request.hub_kwargs)
        request.model.base_model.build_engram_token_map(tokenizer)


def token_map_not_loaded(request: LoadRequest) -> bool:
    """Whether the model has Engram layers and the checkpoint holds no Engram token map (the hub layout, as
    released), so that the map must be built from the checkpoint's tokenizer. Weights given as a state_dict without
    a map keep the default one, with a warning."""
    if not hasattr(request.model.base_model, "engram_token_map"):
        return False
    if request.path is None:
        state_dict = request.kwargs.get("state_dict")
        if state_dict is not None and not any(key.endswith("engram_token_map") for key in state_dict):
            logger.warning(
                "The given state_dict has no engram_token_map: the model keeps the default Engram token map (token "
                "id modulo engram_compressed_vocab_size). Weights trained with a tokenizer need its map: call "
                "model.build_engram_token_map(tokenizer)."
            )
        return False
    return not checkpoint_has_prefix(request.local_folder(), ("engram_token_map", "model.engram_token_map"))


def dequantize_or_cast(request: LoadRequest) -> None:
    apply_weight_mode(request.model, request.kwargs)


def check_finite(request: LoadRequest) -> None:
    if request.check_finite:
        check_finite_weights(request.model)


STEPS = (check_folder, drop_absent_drafter, place_on_devices, prepare_tensor_parallel, load_weights,
         localize_tensor_parallel, attach_engram_tables, spread_over_devices, build_token_map, dequantize_or_cast,
         check_finite)


def load_pretrained(request: LoadRequest):
    """Run the steps in order; returns what transformers' loader returned (the model, or with output_loading_info
    the model and its loading info)."""
    for step in STEPS:
        step(request)
    return request.loaded
