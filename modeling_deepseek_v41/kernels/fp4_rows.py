"""FP4 quantization of rows as the layers and the cache call it: the index queries' QDQ, the packing of index keys
and compressed KV rows, each optionally after rotating the rows' RoPE tail. The exact numerics (`numerics.py`,
`rope.py`) on the CPU; on CUDA inference one Triton launch with the same bits but where the rotation's products
round otherwise (the torch formulation is ~40 small kernels per call, and the rotation five more)."""

from __future__ import annotations

import torch

from . import gpu_linear, numerics
from .dispatch import kernel_path
from .rope import apply_rope_tail


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


def _fused_rotation(x: torch.Tensor, rope_dim: int, block: int) -> bool:
    return kernel_path(x) and x.shape[-1] % block == 0 and rope_dim % block == 0 and 0 < rope_dim <= x.shape[-1]


def rotated_fp4_qdq(x: torch.Tensor, rotation: torch.Tensor, rope_dim: int, block: int, scale_format: str
                    ) -> torch.Tensor:
    """fp4_qdq(apply_rope_tail(x, rotation, rope_dim), block, scale_format): x [..., K] (rows of one rotation may
    span trailing dims, e.g. heads [B,S,H,K] with rotation [B,S,rope/2])."""
    if _fused_rotation(x, rope_dim, block):
        return gpu_linear.triton_kernels().fp4_rows(x, block, scale_format, packed=False, rotation=rotation,
                                                    rope_dim=rope_dim)
    return fp4_qdq(apply_rope_tail(x, rotation, rope_dim), block, scale_format)


def rotated_fp4_rows(x: torch.Tensor, rotation: torch.Tensor, rope_dim: int, block: int, scale_format: str
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(apply_rope_tail(x, rotation, rope_dim), fp4_quantize_rows of it): the rotated rows and their FP4 codes."""
    if _fused_rotation(x, rope_dim, block):
        rotated, codes, scales = gpu_linear.triton_kernels().fp4_rows(x, block, scale_format, packed=True,
                                                                      rotation=rotation, rope_dim=rope_dim)
        return rotated, (codes, scales)
    rotated = apply_rope_tail(x, rotation, rope_dim)
    return rotated, fp4_quantize_rows(rotated, block, scale_format)
