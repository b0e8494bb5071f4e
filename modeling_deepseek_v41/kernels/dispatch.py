"""Accelerator fast paths: small pure functions compiled into fused kernels on first use (decode is
launch-bound on a GPU). Compilation is lazy, so importing the model never imports the compiler."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(function: Callable) -> Callable:
    """`function` compiled with dynamic shapes (once per function, on first use)."""
    return torch.compile(function, dynamic=True)


def fast_path(x: torch.Tensor) -> bool:
    """Whether the accelerator formulations apply to `x`: CUDA inference outside float64. They may differ from
    the CPU reference path in the last bits, so the CPU (and every float64 run) keeps the exact path."""
    return x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled()
