"""Make the CPU take the model's accelerator (CUDA) formulations, for host-cost and graph-capture studies."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def force_accelerator_paths(compiled_replacement: Callable[[Callable], Callable]) -> None:
    """Patch every loaded `modeling_deepseek_v41` module: `fast_path` is true for any non-float64 tensor without
    gradients, and `compiled(f)` becomes `compiled_replacement(f)` (e.g. the eager `f`, or a counting wrapper)."""
    def always(x: torch.Tensor) -> bool:
        return x.dtype != torch.float64 and not torch.is_grad_enabled()

    for name, module in list(sys.modules.items()):
        if name.startswith("modeling_deepseek_v41"):
            if hasattr(module, "fast_path"):
                module.fast_path = always
            if hasattr(module, "compiled"):
                module.compiled = compiled_replacement
