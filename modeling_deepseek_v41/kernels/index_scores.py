"""The CSA2 indexer's scores of pool rows (the op; the layer in layers/indexer.py chooses rows from them)."""

from __future__ import annotations

import torch

from .dispatch import kernel_path
from .gpu_linear import triton_kernels


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """score[b, s, t] = sum_h relu(q[b,s,h] . keys[b,t]) * weights[b,s,h] in q's dtype, like the reference (each
    head's score and its weighted ReLU rounded to it, the sum over heads in fp32, so ties are exact), -inf where
    t >= visible[b, s]. q [B,S,H,HD], weights [B,S,H], keys [B,N,HD], visible [B,S]. On CUDA inference one fused
    launch that writes only the [B,S,N] result."""
    keys = keys.to(q.dtype)
    if kernel_path(q) and weights.dtype == q.dtype and q.shape[-1] in (64, 128, 256):
        return triton_kernels().index_scores(q, weights, keys, visible)
    scores = torch.einsum("bshd,btd->bsht", q, keys)
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
    row_ids = torch.arange(keys.shape[1], device=q.device)
    return scores.masked_fill(row_ids >= visible.unsqueeze(-1), -torch.inf)
