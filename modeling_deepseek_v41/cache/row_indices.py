"""Validation of the row indices a cache is reordered with (beam search, `reorder_cache`)."""

from __future__ import annotations

import torch


def check_row_indices(indices, batch: int) -> None:
    """Refuse indices that are not whole numbers naming existing rows, before any row moves (one host read of their
    range: index_select would otherwise fail deep inside, or with a device assert on CUDA)."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"reorder_cache needs a 1-D LongTensor of row indices, got {type(indices).__name__}; pass "
                         "torch.tensor(indices, dtype=torch.long).")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"reorder_cache needs integer row indices, got dtype {indices.dtype}; pass a LongTensor "
                         "(indices.long()).")
    if indices.dim() != 1 or indices.numel() == 0:
        raise ValueError(f"reorder_cache needs a non-empty 1-D tensor of row indices, got shape "
                         f"{tuple(indices.shape)}.")
    low, high = torch.stack(torch.aminmax(indices)).tolist()
    if low < 0 or high >= batch:
        raise ValueError(f"reorder_cache got row index {low if low < 0 else high}, but the cache holds {batch} rows: "
                         f"indices must lie in [0, {batch - 1}] (negative indices are not accepted).")
