"""FP4 quantization of rows as the layers and the cache call it: the index queries' QDQ, the packing of index keys
and compressed KV rows. The exact numerics (`numerics.py`) on the CPU; on CUDA inference one Triton launch with the
same bits (the torch formulation is ~40 small kernels per call)."""

from __future__ import annotations

import torch

from . import gpu_linear, numerics
from .dispatch import kernel_path


def fp4_qdq(x: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    """numerics.fp4_qdq: FP4 fake-quantization per `block` values (E4M3 or E8M0 scales)."""
    if kernel_path(x) and x.shape[-1] % block == 0:
        return gpu_linear.triton_kernels().fp4_rows(x, block, scale_format, packed=False)
    return numerics.fp4_qdq(x, block, scale_format)


def fp4_quantize_rows(x: torch.Tensor, block: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics.fp4_quantize_rows: packed e2m1 bytes [..., K/2] and fp32 scales [..., K/block]."""
    if kernel_path(x) and x.shape[-1] % block == 0:
        return gpu_linear.triton_kernels().fp4_rows(x, block, scale_format, packed=True)
    return numerics.fp4_quantize_rows(x, block, scale_format)
