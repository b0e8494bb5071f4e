"""The predicates that choose a formulation: the accelerator's fast paths (fewer, larger ops than the reference's
loops) and the Triton kernels for the linears, the MoE and the fused decode ops. The kernels are imported lazily,
so importing the model never imports triton."""

from __future__ import annotations

import torch


def fast_path(x: torch.Tensor) -> bool:
    """Whether the accelerator formulations apply to `x`: CUDA inference outside float64. They may differ from
    the CPU reference path in the last bits, so the CPU (and every float64 run) keeps the exact path."""
    return x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled()


def kernel_path(x: torch.Tensor) -> bool:
    """Whether `x` goes through the Triton kernels (kernels/triton/): CUDA, outside float64, not recording
    gradients (a frozen quantized linear's autograd Function calls them from its forward and backward, which run
    without grad); an empty call launches nothing."""
    return x.is_cuda and x.dtype != torch.float64 and not torch.is_grad_enabled() and x.numel() > 0
