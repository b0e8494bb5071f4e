"""Interleaved-pair rotary embedding on the last `rope_dim` dims (the rotations themselves come from the layers'
`DeepseekV41Rotary`): the exact math, also the reference of the fused kernels that rotate inside their launch."""

from __future__ import annotations

import torch

from .numerics import compute_dtype


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope dims of x, taken as interleaved (real, imag) pairs.

    x: [B, S, rope_dim] or [B, S, H, rope_dim]; rotation: [B, S, rope_dim/2] complex. Returns a new tensor of
    x's dtype; the product is taken in complex64 (complex128 for float64 inputs) as the reference does.
    """
    complex_dtype = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    real_dtype = compute_dtype(x)
    pairs = torch.view_as_complex(x.to(real_dtype).unflatten(-1, (-1, 2)).contiguous())
    rotation = rotation.to(complex_dtype)
    if inverse:
        rotation = rotation.conj()
    if x.dim() == 4:
        rotation = rotation.unsqueeze(2)
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def apply_rope_tail(x: torch.Tensor, rotation: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """Apply rotary embedding to the last `rope_dim` features of x and leave the rest untouched."""
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    return torch.cat([head, apply_rope(tail, rotation, inverse)], dim=-1)
