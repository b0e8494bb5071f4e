"""Engram's hashing of n-grams into table rows (the op; the primes, multipliers and token map are
layers/engram_hashing.py's): the exact integer math, and one launch on CUDA inference instead of about forty."""

from __future__ import annotations

import torch

from .dispatch import kernel_path
from .gpu_linear import triton_kernels

DEAD = -1  # compressed id of a position that takes no part in any n-gram


def ngram_window(compressed: torch.Tensor, pad_id: int | torch.Tensor, max_ngram: int, width: int) -> torch.Tensor:
    """Tokens at shifts 0..max_ngram-1 for the last `width` positions of a compressed-id history [B, T].

    A shift is blocked (takes `pad_id`) before the history start or at/after the first dead token going back.
    """
    total = compressed.shape[1]
    positions = torch.arange(total - width, total, device=compressed.device)
    blocked = torch.zeros(compressed.shape[0], width, dtype=torch.bool, device=compressed.device)
    shifted = []
    for shift in range(max_ngram):
        source = compressed[:, (positions - shift).clamp_min(0)]
        blocked = blocked | (positions < shift) | (source == DEAD)
        shifted.append(torch.where(blocked, pad_id, source))  # pad_id may be a 0-dim tensor: no host read
    return torch.stack(shifted, dim=-1)


def engram_hash_ids(tokens: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                    multipliers: torch.Tensor) -> torch.Tensor:
    """[B, S, max_ngram] shifted tokens -> [B, S, n_layers, (max_ngram-1)*heads] global table rows."""
    products = tokens.unsqueeze(2) * multipliers  # [B, S, L, max_ngram]; bounded so it cannot overflow
    rolling = products[..., 0]
    columns = []
    for n in range(1, products.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., n])
        columns.append(rolling.unsqueeze(-1) % primes[:, n - 1])
    return torch.cat(columns, dim=-1) + offsets


def engram_rows(history: torch.Tensor, pad_id: torch.Tensor, max_ngram: int, width: int, primes: torch.Tensor,
                offsets: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """Global table rows [B, width, n_layers, (max_ngram-1)*heads] of the last `width` positions of a compressed-id
    history [B, T]: their 2- .. max_ngram-grams (ngram_window) hashed per layer and head (engram_hash_ids).
    primes [L, max_ngram-1, heads], offsets [L, (max_ngram-1)*heads], multipliers [L, max_ngram] (int64)."""
    if kernel_path(history) and torch.is_tensor(pad_id):  # integer math: the same bits on every device
        return triton_kernels().engram_rows(history, pad_id, max_ngram, width, primes, offsets, multipliers)
    return engram_hash_ids(ngram_window(history, pad_id, max_ngram, width), primes, offsets, multipliers)
