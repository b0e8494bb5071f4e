"""Placing DeepSeek-V4.1 over several devices with accelerate: the attention side on one device, the MoE layers
(and Engram tables kept as parameters) spread over the others.

Why not accelerate's block-by-block split: the CSA2 layers hand compressed pools, index keys and top-k selections
to later layers within a forward, and the cache holds them between forwards. Keeping every attention, norm, mHC
mix and the cache on one "main" device means none of that state crosses devices. The experts (543.6B of the 552B
backbone parameters) are what needs spreading; an MoE layer only sees [tokens, hidden] go in and come out, and its
accelerate hook moves the result back to the main device (`io_same_device`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

OFFLOAD_DEVICES = ("cpu", "disk")
_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def multi_device_map(device_map) -> str:
    """How a device_map argument places the model: "auto" (ours, on CUDA), "explicit" over several devices, or ""."""
    if isinstance(device_map, str) and device_map in _AUTO_MAPS and torch.cuda.device_count() > 0:
        return "auto"
    if isinstance(device_map, dict) and len({d for d in device_map.values() if d not in ("cpu", "disk")}) > 1:
        return "explicit"
    return ""


def resolve_device_map(skeleton: nn.Module, device_map, max_memory: dict | None):
    """The device map to load with, from a meta-device skeleton: the CSA2-aware map for "auto", or the given map
    after checking that it keeps each layer's attention side on one device."""
    if multi_device_map(device_map) == "auto":
        return deepseek_device_map(skeleton, max_memory)
    check_device_map(skeleton, device_map)
    return device_map


def spread_units(model: nn.Module) -> list[str]:
    """Modules placed on their own: every MoE layer (backbone and drafter) and every Engram table held as a
    parameter (host/mmap tables are not parameters and are not placed at all)."""
    units = []
    for name, module in model.named_modules():
        if name.endswith(".ffn") and hasattr(module, "experts"):
            units.append(name)
        elif name.endswith(".engram.embed") and any(True for _ in module.parameters()):
            units.append(name)
    return units


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (works on the meta device)."""
    return sum(t.nbytes for t in module.parameters()) + sum(t.nbytes for t in module.buffers())


def _main_keys(model: nn.Module, units: set[str]) -> list[str]:
    """Device-map keys covering everything outside the spread units: whole modules where possible, and the
    direct parameters and buffers of the modules that contain a unit."""
    keys = []

    def visit(prefix: str, module: nn.Module) -> None:
        inside = [u for u in units if prefix == "" or u.startswith(prefix + ".")]
        if not inside:
            keys.append(prefix)
            return
        for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            keys.append(f"{prefix}.{name}" if prefix else name)
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full not in units:
                visit(full, child)

    visit("", model)
    return keys


def deepseek_device_map(model: nn.Module, max_memory: dict | None = None, main_reserve: float = 0.15
                        ) -> dict[str, int | str]:
    """A device map for `model` (built on the meta device is enough).

    `max_memory` maps devices to bytes in placement order (e.g. {0: 130e9, 1: 130e9, "cpu": 400e9}); the first is
    the main device, which holds the attention side, the cache and the activations, so `main_reserve` of it is
    left free. The MoE layers and device-stored Engram tables are then placed largest first, each on the
    accelerator with the most room left; what fits on none goes to "cpu" if listed, then "disk" (accelerate
    offload, executed on the main device).
    """
    if max_memory is None:
        from accelerate.utils import get_max_memory

        max_memory = get_max_memory()
    devices = [d for d in max_memory if d != "disk"]
    if not devices:
        raise ValueError("max_memory names no device to place the model on.")
    main = devices[0]
    units = spread_units(model)
    modules = dict(model.named_modules())
    main_keys = _main_keys(model, set(units))
    main_bytes = sum(key_bytes(model, modules, key) for key in main_keys)
    room = {d: float(max_memory[d]) for d in devices}
    room[main] = room[main] * (1 - main_reserve) - main_bytes
    if room[main] < 0:
        raise ValueError(
            f"The attention side of the model ({main_bytes / 2**30:.1f} GiB) does not fit on the main device "
            f"{main!r} ({max_memory[main] / 2**30:.1f} GiB with {main_reserve:.0%} kept free)."
        )
    device_map: dict[str, int | str] = dict.fromkeys(main_keys, main)
    accelerators = [d for d in devices if d not in OFFLOAD_DEVICES]
    offload = [d for d in devices if d in OFFLOAD_DEVICES]
    # every MoE call goes from the main device and back, so model order does not matter: largest units first,
    # each onto the accelerator with the most room left (balances the devices), then host, then disk
    for size, unit in sorted(((module_bytes(modules[u]), u) for u in units), key=lambda item: -item[0]):
        fits = [d for d in accelerators if room[d] >= size] or [d for d in offload if room[d] >= size]
        device = max(fits, key=lambda d: room[d]) if fits else "disk"
        if device != "disk":
            room[device] -= size
        device_map[unit] = device
    return device_map


def key_bytes(model: nn.Module, modules: dict[str, nn.Module], key: str) -> int:
    """Bytes a device-map key places: a whole module, or one direct parameter or buffer (`modules`: the model's
    named_modules(), passed in so that a caller summing many keys builds it once)."""
    if key in modules:
        return module_bytes(modules[key])
    owner, _, name = key.rpartition(".")
    tensor = getattr(modules[owner] if owner else model, name)
    return tensor.nbytes if isinstance(tensor, torch.Tensor) else 0


def attention_side_devices(model: nn.Module, device_map: dict) -> set:
    """The accelerator devices a device map puts the attention side on (offloaded parts run on the main device)."""
    units = spread_units(model)
    found = set()
    for key, device in device_map.items():
        if device in OFFLOAD_DEVICES:
            continue
        if any(key == u or key.startswith(u + ".") for u in units):
            continue
        found.add(device)
    return found


def check_device_map(model: nn.Module, device_map: dict) -> None:
    """Refuse a map that splits the attention side over accelerators (the CSA2 pools and the cache would have to
    cross devices inside a forward); say what to use instead."""
    devices = attention_side_devices(model, device_map)
    if len(devices) > 1:
        raise ValueError(
            f"This device_map puts attention layers on several devices ({sorted(map(str, devices))}). DeepSeek-V4.1 "
            "keeps the attention side (every attention, norm and mHC mix, and the cache) on one device and spreads "
            "only the MoE layers: use device_map='auto', or build a map with "
            "modeling_deepseek_v41.loading.device_map.deepseek_device_map(model, max_memory)."
        )


def return_to_input_device(model: nn.Module, units: Iterable[str] | None = None) -> None:
    """Make the accelerate hook of every spread unit hand its output back on the device its input came from."""
    modules = dict(model.named_modules())
    for unit in units if units is not None else spread_units(model):
        for hook in _hooks(modules[unit]):
            if hasattr(hook, "io_same_device"):
                hook.io_same_device = True


def _hooks(module: nn.Module) -> list:
    """accelerate's hooks on a module (one, or the chain of a SequentialHook)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", [hook]))


def preload_submodules(model: nn.Module) -> None:
    """An offloaded attention reads `wo_a`'s weight directly (the grouped output projection), not through
    `wo_a`'s forward, so accelerate's per-module offload hook would leave it on the meta device: make every
    offloaded attention's hook bring in its submodules' weights for the duration of its forward."""
    from ..layers.attention import DeepseekV41Attention

    for module in model.modules():
        if isinstance(module, DeepseekV41Attention):
            for hook in _hooks(module):
                if getattr(hook, "offload", False):
                    hook.place_submodules = True
