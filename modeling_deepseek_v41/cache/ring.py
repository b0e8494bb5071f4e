"""A layer's window ring (FP8 window KV by position modulo its size) and the view of it that a layer's `window`
call returns (`RingWindow`)."""

from __future__ import annotations

import copy

import torch

from ..kernels.dispatch import kernel_path
from ..kernels.gpu_linear import triton_kernels
from ..kernels.sparse_attention import StoredWindow, list_window
from .packed_rows import PackedRows, latest_positions


class Ring:
    """A layer's window KV: FP8 rows in `size` slots indexed by position modulo size, with each slot's position.
    A `fixed` ring (static decode) lists a fixed width every step; entries the window does not reach yet are
    masked."""

    def __init__(self, size: int, head_dim: int, batch: int, device: torch.device) -> None:
        self.size = size
        self.rows = PackedRows("fp8_e8m0", batch, head_dim, size, device)
        self.positions = torch.full((batch, size), -1, dtype=torch.long, device=device)
        self.fixed = False

    @property
    def nbytes(self) -> int:
        """The ring's bytes, every slot allocated."""
        return self.rows.nbytes

    def fix(self, columns: int) -> None:
        self.fixed = True  # the slots are fixed already: only the listed width stops following the chunk

    def unfix(self) -> None:
        self.fixed = False

    def width(self, window: int, chunk_max_length: int) -> int:
        """How many entries the chunk's last queries list (the most any of its queries lists)."""
        return window if self.fixed else min(window, chunk_max_length)

    def holds_chunk(self, length: int, window: int) -> bool:
        """Whether a chunk of `length` tokens can be written before it is attended: its entries never overwrite a
        slot an earlier query of the chunk still lists (chunks of up to size - window + 1 tokens)."""
        return length <= self.size - window + 1

    def stored(self, width: int) -> StoredWindow:
        return StoredWindow(self.rows.codes, self.rows.scales, self.positions, width)

    def spanning(self, chunk_kv: torch.Tensor, positions: torch.Tensor, chunk_start: torch.Tensor) -> Ring:
        """A ring of size + S slots holding this ring's entries before `chunk_start` [B] and the chunk's KV
        [B,S,hd] at `positions`: every window a query of a long chunk lists, in one ring (the fused attention's)."""
        batch, seq, dim = chunk_kv.shape
        held = self.rows.read(self.size, chunk_kv.dtype)
        earlier = torch.where(self.positions < chunk_start.view(-1, 1), self.positions, -1)  # a replay's: the chunk's
        wide = Ring(self.size + seq, dim, batch, chunk_kv.device)
        wide.write(torch.cat([held, chunk_kv], dim=1), torch.cat([earlier, positions], dim=1))
        return wide

    def snapshot(self) -> Ring:
        """A copy of the ring as it is now (what a long chunk's queries list once the chunk overwrote slots)."""
        held = copy.copy(self)
        held.rows = self.rows.clone()
        held.positions = self.positions.clone()
        return held

    def write(self, chunk_kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Store the chunk's window KV [B,S,hd] at positions [B,S] (-1: padding, not stored)."""
        if kernel_path(chunk_kv) and chunk_kv.shape[-1] % 32 == 0 \
                and chunk_kv.shape[-1] & (chunk_kv.shape[-1] - 1) == 0:  # one launch, nothing read back
            if positions.shape[1] > self.size:  # what a long chunk leaves: the rest written as padding
                positions = torch.where(latest_positions(positions, self.size), positions, -1)
            triton_kernels().ring_write(chunk_kv, positions, self.rows.codes, self.rows.scales, self.positions)
            return
        if self.fixed or positions.shape[1] == 1:  # a token per row per scatter: nothing read back
            for s in range(positions.shape[1]):
                live = positions[:, s] >= 0
                slots = positions[:, s] % self.size
                self.rows.write_one_per_row(slots, chunk_kv[:, s], live)
                self.positions.scatter_(1, slots.unsqueeze(1), torch.where(
                    live, positions[:, s], self.positions.gather(1, slots.unsqueeze(1)).squeeze(1)).unsqueeze(1))
            return
        keep = latest_positions(positions, self.size)
        batch_ids = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1).expand_as(positions)
        slots = positions % self.size
        self.rows.write(batch_ids[keep], slots[keep], chunk_kv[keep])
        self.positions[batch_ids[keep], slots[keep]] = positions[keep]

    def list_entries(self, chunk_kv: torch.Tensor, positions: torch.Tensor, window: int, width: int,
                     floor: torch.Tensor | None, offset: int, chunk_start: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's `width` window entries [B,S,L,hd] (oldest first) and validity: positions from
        `chunk_start` [B] on from the chunk, earlier ones from this ring; `positions` are the queries of a slice
        of the chunk starting at chunk index `offset`."""
        start = chunk_start.view(-1, 1, 1)
        listed, valid, chunk_index = list_window(positions, window, width, floor, offset)
        in_chunk = listed >= start
        chunk_index = torch.where(valid & in_chunk, chunk_index, 0)
        ring_slot = torch.where(valid & ~in_chunk, listed % self.size, 0)
        batch_ids = torch.arange(positions.shape[0], device=positions.device).view(-1, 1, 1)
        valid = valid & (in_chunk | (self.positions[batch_ids, ring_slot] == listed))  # a ring slot may be empty
        from_chunk = gather_rows(chunk_kv, chunk_index)
        from_ring = self.rows.gather(ring_slot, chunk_kv.dtype)
        entries = torch.where((valid & in_chunk).unsqueeze(-1), from_chunk, from_ring)
        return entries, valid

    def drafter_window(self, last: torch.Tensor, window: int, max_length: int, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter stage's window: the last `window` backbone positions up to `last` [B], listed by ring slot
        (position modulo window) as the reference lists them. Returns values [B,L,hd] and validity [B,L]."""
        width = window if self.fixed else min(window, max_length)  # last = lengths - 1; fixed: one shape
        slots = torch.arange(width, device=last.device)
        listed = last.unsqueeze(1) - (last.unsqueeze(1) - slots) % window
        valid = (slots <= last.unsqueeze(1)) & (listed >= 0)
        values = self.rows.gather(torch.where(valid, listed % self.size, 0), dtype)
        return values, valid

    def crop(self, lengths: torch.Tensor) -> None:
        """Forget the slots of positions at or past each row's length."""
        self.positions.masked_fill_(self.positions >= lengths.unsqueeze(1), -1)  # in place: a graph reads it

    def select(self, indices: torch.Tensor) -> None:
        self.rows.select_batch(indices)
        self.positions = self.positions.index_select(0, indices)


class RingWindow:
    """A layer's window on a cache for the queries of one chunk, once the chunk is written: each query's entries
    listed from the chunk and from `ring`, the ring as it was before the chunk (a copy, when the chunk overwrote
    slots its queries list). `stored`, for a decode-sized chunk, is the written ring itself, which then holds
    every entry (the fused attention reads it); on CUDA a longer chunk's is its spanning ring (`Ring.spanning`)."""

    def __init__(self, ring: Ring, chunk_kv: torch.Tensor, positions: torch.Tensor, window: int,
                 floor: torch.Tensor | None, chunk_start: torch.Tensor, widest: int,
                 stored: StoredWindow | None) -> None:
        self.ring, self.chunk_kv, self.positions, self.window = ring, chunk_kv, positions, window
        self.floor, self.chunk_start, self.widest, self.stored = floor, chunk_start, widest, stored

    def entries(self, queries: slice) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.positions[:, queries]
        if self.ring.fixed or queries.start + positions.shape[1] == self.chunk_kv.shape[1]:
            width = self.widest  # the chunk's last queries list the most, known without a device read
        else:
            width = min(self.window, int(positions.amax()) + 1) if positions.numel() else 0
        return self.ring.list_entries(self.chunk_kv, positions, self.window, width, self.floor, queries.start,
                                      self.chunk_start)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source [B,N,d], index [B,S,K] (valid ids) -> [B,S,K,d]."""
    batch, s, k = index.shape
    flat = index.reshape(batch, s * k, 1).expand(-1, -1, source.shape[-1])
    return source.gather(1, flat).view(batch, s, k, source.shape[-1])
