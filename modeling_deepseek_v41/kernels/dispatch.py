"""Accelerator fast paths: small pure functions compiled into fused kernels on first use (decode is
launch-bound on a GPU), and the predicate that sends the linears and the MoE to the Triton kernels. Compilation
and the kernels are imported lazily, so importing the model never imports the compiler or triton."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(function: Callable) -> Callable:
    """`function` compiled with dynamic shapes (once per function, on first use). Inductor keeps every bf16 rounding
    the function writes (by default it fuses a bf16 round trip away: the probabilities' rounding the reference does)."""
    return torch.compile(function, dynamic=True, options={"emulate_precision_casts": True})


def fast_path(x: torch.Tensor) -> bool:
    """Whether the accelerator formulations apply to `x`: CUDA inference outside float64. They may differ from
    the CPU reference path in the last bits, so the CPU (and every float64 run) keeps the exact path."""
    return x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled()


def kernel_path(x: torch.Tensor) -> bool:
    """Whether `x` goes through the Triton kernels (kernels/triton/): CUDA, outside float64, not recording
    gradients (a frozen quantized linear's autograd Function calls them from its forward and backward, which run
    without grad); an empty call launches nothing."""
    return x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled() and x.numel() > 0
