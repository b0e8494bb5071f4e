"""The CSA2 indexer's scores of pool rows (the ops; the layer in layers/indexer.py chooses rows from them). Keys
come as values [B, N, HD] or as a cache stores them (`StoredKeys`: FP4 codes and E8M0 scales), which the kernels
decode in registers and the exact path unpacks (only the rows it gathers, for candidates)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import kernel_path
from .gpu_linear import triton_kernels
from .numerics import fp4_dequantize_rows


class StoredKeys(NamedTuple):
    """A pool's index keys as a cache stores them; the first `rows` rows are visible."""

    codes: torch.Tensor  # [B, capacity, HD/2] uint8: e2m1 pairs, the even element in the low nibble
    scales: torch.Tensor  # [B, capacity, HD/32] uint8: E8M0 bytes
    rows: int


def key_rows(keys: torch.Tensor | StoredKeys) -> int:
    """How many pool rows the keys hold (visible to this forward)."""
    return keys.rows if isinstance(keys, StoredKeys) else keys.shape[1]


def _values(keys: torch.Tensor | StoredKeys, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(keys, StoredKeys):
        return fp4_dequantize_rows(keys.codes[:, :keys.rows], keys.scales[:, :keys.rows], dtype)
    return keys.to(dtype)


def _fused(q: torch.Tensor, weights: torch.Tensor) -> bool:
    return kernel_path(q) and weights.dtype == q.dtype and q.shape[-1] in (64, 128, 256)


def _kernel_keys(keys: torch.Tensor | StoredKeys, dtype: torch.dtype):
    return (keys.codes, keys.scales) if isinstance(keys, StoredKeys) else keys.to(dtype)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | StoredKeys, visible: torch.Tensor
                 ) -> torch.Tensor:
    """score[b, s, t] = sum_h relu(q[b,s,h] . keys[b,t]) * weights[b,s,h] in q's dtype, like the reference (each
    head's score and its weighted ReLU rounded to it, the sum over heads in fp32, so ties are exact), -inf where
    t >= visible[b, s]. q [B,S,H,HD], weights [B,S,H], keys [B,N,HD] or StoredKeys, visible [B,S]. On CUDA
    inference one fused launch that writes only the [B,S,N] result (stored keys decoded in it)."""
    if _fused(q, weights):
        return triton_kernels().index_scores(q, weights, _kernel_keys(keys, q.dtype), visible, key_rows(keys))
    keys = _values(keys, q.dtype)
    scores = torch.einsum("bshd,btd->bsht", q, keys)
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
    row_ids = torch.arange(keys.shape[1], device=q.device)
    return scores.masked_fill(row_ids >= visible.unsqueeze(-1), -torch.inf)


def candidate_positions(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Chosen block ids [B,S,nb] -> the compressed positions they hold [B,S,nb*block_size], ascending (-1 unused)."""
    offsets = torch.arange(block_size, device=blocks.device)
    positions = blocks.unsqueeze(-1) * block_size + offsets
    return torch.where(blocks.unsqueeze(-1) >= 0, positions, -1).flatten(-2)


def _gathered_keys(keys: torch.Tensor | StoredKeys, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """keys at rows [B, M] (valid ids) -> [B, M, HD] in dtype, unpacking only those rows of stored keys."""
    if isinstance(keys, StoredKeys):
        codes = keys.codes.gather(1, rows.unsqueeze(-1).expand(-1, -1, keys.codes.shape[-1]))
        scales = keys.scales.gather(1, rows.unsqueeze(-1).expand(-1, -1, keys.scales.shape[-1]))
        return fp4_dequantize_rows(codes, scales, dtype)
    return keys.to(dtype).gather(1, rows.unsqueeze(-1).expand(-1, -1, keys.shape[-1]))


def candidate_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | StoredKeys, visible: torch.Tensor,
                     blocks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index_scores of each query's candidate positions only (its chosen blocks [B,S,nb] of block_size positions,
    -1 unused): (scores [B,S,W], positions [B,S,W] ascending, W = nb * block_size), the score -inf and the
    position -1 where it is unused or not yet visible. The cost is independent of the pool's length. On CUDA
    inference one launch (keys gathered and decoded in it)."""
    if _fused(q, weights):
        return triton_kernels().candidate_scores(q, weights, _kernel_keys(keys, q.dtype), visible, blocks, block_size)
    positions = candidate_positions(blocks, block_size)
    valid = (positions >= 0) & (positions < visible.unsqueeze(-1))
    batch, seq, width = positions.shape
    gathered = _gathered_keys(keys, torch.where(valid, positions, 0).reshape(batch, seq * width), q.dtype)
    scores = torch.einsum("bshd,bsmd->bshm", q, gathered.view(batch, seq, width, -1))
    scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2).masked_fill(~valid, -torch.inf)
    return scores, torch.where(valid, positions, -1)
