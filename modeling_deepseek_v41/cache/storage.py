"""The records a DeepseekV41Cache is made of: a KV source's pool (packed rows, index keys, carry, recent raw
tokens), a growing per-column record, and a layer's window ring."""

from __future__ import annotations

import torch

from ..kernels.sparse_attention import list_window  # noqa: F401  (the cache's import point)
from .packed_rows import PackedRows


class Pool:
    """One KV source's compressed rows and index keys, plus its raw recent tokens for restoring a carry."""

    def __init__(self, ratio: int, head_dim: int, index_dim: int, batch: int, horizon: int,
                 device: torch.device, compute_dtype: torch.dtype) -> None:
        self.ratio = ratio
        self.kv = PackedRows("fp4_e4m3", batch, head_dim, 0, device)
        self.keys = PackedRows("fp4_e8m0", batch, index_dim, 0, device)
        self.carry: tuple[torch.Tensor, torch.Tensor] | None = None
        # the fp32 projections of the last `horizon + ratio` tokens, by position modulo that size
        self.recent_size = horizon + ratio if ratio > 1 else 0
        shape = (batch, self.recent_size, head_dim)
        self.recent_kv = torch.zeros(shape, dtype=compute_dtype, device=device)
        self.recent_score = torch.full(shape, -torch.inf, dtype=compute_dtype, device=device)

    def carry_at(self, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The carry after `lengths` tokens: slots of the open group's tokens, from the raw recent tokens."""
        r = self.ratio
        group_start = (lengths // r) * r
        slots = torch.arange(r, device=lengths.device)
        token_pos = group_start.unsqueeze(1) + slots
        present = token_pos < lengths.unsqueeze(1)
        index = (token_pos % self.recent_size).unsqueeze(-1).expand(-1, -1, self.recent_kv.shape[-1])
        kv = torch.where(present.unsqueeze(-1), self.recent_kv.gather(1, index), 0)
        score = torch.where(present.unsqueeze(-1), self.recent_score.gather(1, index), -torch.inf)
        return kv, score


class Columns:
    """A [B, columns] record that grows by doubling its capacity (no per-step copy of the whole history)."""

    def __init__(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(batch, 16, dtype=dtype, device=device)

    def write(self, start: int, values: torch.Tensor) -> None:
        end = start + values.shape[1]
        if end > self.buffer.shape[1]:
            grown = self.buffer.new_zeros(self.buffer.shape[0], max(end, 2 * self.buffer.shape[1]))
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown
        self.buffer[:, start:end] = values

    def write_at(self, column: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [B, 1] at a column held on the device (a static decode step): no host int involved."""
        self.buffer.scatter_(1, column.expand(self.buffer.shape[0], 1), values.to(self.buffer.dtype))

    def reserve(self, columns: int) -> None:
        if columns > self.buffer.shape[1]:
            grown = self.buffer.new_zeros(self.buffer.shape[0], columns)
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown

    def view(self, start: int, end: int) -> torch.Tensor:
        return self.buffer[:, start:end]

    def select(self, index: torch.Tensor) -> None:
        self.buffer = self.buffer.index_select(0, index)


class Ring:
    """A layer's window KV: FP8 rows in `size` slots indexed by position modulo size, with each slot's position."""

    def __init__(self, size: int, head_dim: int, batch: int, device: torch.device) -> None:
        self.size = size
        self.rows = PackedRows("fp8_e8m0", batch, head_dim, size, device)
        self.positions = torch.full((batch, size), -1, dtype=torch.long, device=device)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    batch, s, k = index.shape
    flat = index.reshape(batch, s * k, 1).expand(-1, -1, source.shape[-1])
    return source.gather(1, flat).view(batch, s, k, source.shape[-1])
