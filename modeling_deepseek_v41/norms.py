"""RMSNorm as the reference computes it: normalize in fp32 and multiply by the weight before casting back."""

from __future__ import annotations

import torch
from torch import nn

from .numerics import compute_dtype, weight_dtype


class DeepseekV41RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the fp32 normalized value (HF's usual order casts first: not bit-equal)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=weight_dtype(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
