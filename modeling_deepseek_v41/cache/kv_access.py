"""How the layers read and write a DeepseekV41Cache within a forward: window rings (listing each query's window
from the ring and the chunk), drafter windows, and the CSA2 pools (rows, index keys, carries)."""

from __future__ import annotations

import torch

from ..kernels.dispatch import kernel_path
from ..kernels.gpu_linear import triton_kernels
from ..kernels.sparse_attention import StoredPool, StoredWindow
from .storage import Pool, gather_rows, list_window


class KVAccessMixin:
    """The per-layer reads and writes of DeepseekV41Cache (its `rings`, `pools` and chunk bookkeeping): the
    store interface the attention layers use, which `ChunkStore` also implements for a forward without a cache."""

    decodes_incrementally = True  # steps of a few tokens over cached pools (the indexers may gather candidates)
    fixed_shapes = True  # the compressor emits a row per group of the chunk; the cache drops the unused ones

    def pool_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions that still need pool rows (replayed tokens already have theirs): others become -1."""
        return torch.where(positions >= self.lengths.unsqueeze(1), positions, -1)

    # -- window rings ---------------------------------------------------------------------------------------
    def window_entries(self, layer_id: int, chunk_kv: torch.Tensor, positions: torch.Tensor, window: int,
                       floor: torch.Tensor | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's window entries [B,S,L,hd] (oldest first) and validity, from the ring and the chunk.
        `floor` [B], when given, hides positions below it (a window restricted to a replayed segment);
        `positions` may be the queries of a slice of the chunk starting at chunk index `offset`."""
        ring = self.rings[layer_id]
        start = self.chunk_start.view(-1, 1, 1)
        if self.is_static:  # a fixed width; entries the window does not reach yet are masked
            width = window
        elif offset + positions.shape[1] == chunk_kv.shape[1]:  # the chunk's last queries: the widest is known
            width = min(window, self.chunk_max_length)
        else:
            width = min(window, int(positions.amax()) + 1) if positions.numel() else 0
        listed, valid, chunk_index = list_window(positions, window, width, floor, offset)
        in_chunk = listed >= start
        chunk_index = torch.where(valid & in_chunk, chunk_index, 0)
        ring_slot = torch.where(valid & ~in_chunk, listed % ring.size, 0)
        batch_ids = torch.arange(positions.shape[0], device=positions.device).view(-1, 1, 1)
        valid = valid & (in_chunk | (ring.positions[batch_ids, ring_slot] == listed))  # a ring slot may be empty
        from_chunk = gather_rows(chunk_kv, chunk_index)
        from_ring = ring.rows.gather(ring_slot, chunk_kv.dtype)
        entries = torch.where((valid & in_chunk).unsqueeze(-1), from_chunk, from_ring)
        return entries, valid

    def window_storage(self, layer_id: int, chunk_length: int) -> StoredWindow | None:
        """The layer's ring for queries that read their whole window from it (after write_window): chunks of up to
        crop_horizon + 1 tokens, whose entries never overwrite a slot an earlier query of the chunk still lists."""
        ring = self.rings[layer_id]
        window = self.text_config.sliding_window
        if chunk_length > ring.size - window + 1:
            return None
        width = window if self.is_static else min(window, self.chunk_max_length)
        return StoredWindow(ring.rows.codes, ring.rows.scales, ring.positions, width)

    def pool_storage(self, source: int) -> StoredPool:
        pool = self.pools[source].kv
        return StoredPool(pool.codes, pool.scales)

    def write_window(self, layer_id: int, chunk_kv: torch.Tensor, positions: torch.Tensor) -> None:
        ring = self.rings[layer_id]
        if kernel_path(chunk_kv) and positions.shape[1] <= ring.size and chunk_kv.shape[-1] % 32 == 0 \
                and chunk_kv.shape[-1] & (chunk_kv.shape[-1] - 1) == 0:  # one launch, nothing read back
            triton_kernels().ring_write(chunk_kv, positions, ring.rows.codes, ring.rows.scales, ring.positions)
            return
        if positions.shape[1] == 1:  # one token per row: written without reading anything back
            live = positions[:, 0] >= 0
            slots = positions[:, 0] % ring.size
            ring.rows.write_one_per_row(slots, chunk_kv[:, 0], live)
            ring.positions.scatter_(1, slots.unsqueeze(1), torch.where(
                live, positions[:, 0], ring.positions.gather(1, slots.unsqueeze(1)).squeeze(1)).unsqueeze(1))
            return
        end = torch.where(positions >= 0, positions, -1).amax(dim=1, keepdim=True)
        keep = (positions >= 0) & (positions > end - ring.size)
        batch_ids = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1).expand_as(positions)
        slots = positions % ring.size
        ring.rows.write(batch_ids[keep], slots[keep], chunk_kv[keep])
        ring.positions[batch_ids[keep], slots[keep]] = positions[keep]

    def drafter_window(self, layer_id: int, last: torch.Tensor, window: int, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter stage's window: the last `window` backbone positions up to `last` [B], listed by ring slot
        (position modulo window) as the reference lists them. Returns values [B,L,hd] and validity [B,L]."""
        ring = self.rings[layer_id]
        width = min(window, self.max_length)  # last = lengths - 1
        slots = torch.arange(width, device=last.device)
        listed = last.unsqueeze(1) - (last.unsqueeze(1) - slots) % window
        valid = (slots <= last.unsqueeze(1)) & (listed >= 0)
        values = ring.rows.gather(torch.where(valid, listed % ring.size, 0), dtype)
        return values, valid

    # -- pools ----------------------------------------------------------------------------------------------
    def carry(self, source: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.pools[source].carry

    def pool_rows_after_chunk(self, source: int) -> int:
        """Rows of the pool the longest batch row will have completed once this chunk is written (in static mode
        the pool's whole capacity: rows not written yet are masked by each query's visible count)."""
        if self.is_static:
            return self.pools[source].kv.capacity
        return self.chunk_max_length // self.pools[source].ratio

    def write_pool(self, source: int, rows: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   keys: tuple[torch.Tensor, torch.Tensor], carry, token_kv: torch.Tensor | None,
                   token_score: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Store the chunk's completed rows (codes and scales of their QDQ), the new carry, and raw tokens."""
        pool = self.pools[source]
        total = self.pool_rows_after_chunk(source)
        pool.kv.ensure_capacity(max(total, 1))  # a step's skipped writes land on row 0
        pool.keys.ensure_capacity(max(total, 1))
        if rows.shape[1] == 1 and positions.shape[1] == 1:
            self._write_pool_step(pool, rows[:, 0], kv, keys, carry, token_kv, token_score, positions[:, 0])
            return
        done = rows >= 0
        batch_ids = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1).expand_as(rows)
        pool.kv.write_codes(batch_ids[done], rows[done], kv[0][done], kv[1][done])
        pool.keys.write_codes(batch_ids[done], rows[done], keys[0][done], keys[1][done])
        if pool.ratio > 1:
            pool.carry = carry
            live = positions >= 0
            b = torch.arange(positions.shape[0], device=rows.device).unsqueeze(1).expand_as(positions)[live]
            slot = positions[live] % pool.recent_size
            pool.recent_kv[b, slot] = token_kv[live].to(pool.recent_kv.dtype)
            pool.recent_score[b, slot] = token_score[live].to(pool.recent_score.dtype)

    def _write_pool_step(self, pool: Pool, rows: torch.Tensor, kv, keys, carry, token_kv, token_score,
                         positions: torch.Tensor) -> None:
        """write_pool for one token and at most one new row per batch row, without reading anything back."""
        done = rows >= 0
        pool.kv.write_codes_one_per_row(rows, kv[0][:, 0], kv[1][:, 0], done)
        pool.keys.write_codes_one_per_row(rows, keys[0][:, 0], keys[1][:, 0], done)
        if pool.ratio > 1:
            if self.is_static:  # in place: a replayed graph reads the carry where it wrote it
                for stored, new in zip(pool.carry, carry):
                    stored.copy_(new)
            else:
                pool.carry = carry
            live = (positions >= 0).view(-1, 1, 1)
            index = (positions % pool.recent_size).view(-1, 1, 1).expand(-1, 1, pool.recent_kv.shape[-1])
            for store, values in ((pool.recent_kv, token_kv), (pool.recent_score, token_score)):
                store.scatter_(1, index, torch.where(live, values.to(store.dtype), store.gather(1, index)))

    def store_pool(self, source: int, out, rotated: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   keys: torch.Tensor, key_codes: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                   key_dtype: torch.dtype):
        """Write a compressor's output (`out`: rows, carry, raw tokens) as packed pool rows and index keys;
        returns what the indexers read as this source's keys: a function unpacking them (in `key_dtype`) on
        first use (scanning the compressed history is the indexers' job)."""
        total = self.pool_rows_after_chunk(source)
        self.write_pool(source, out.rows, kv, key_codes, out.carry, out.token_kv, out.token_score, positions)
        return lambda: self.pool_keys(source, total, key_dtype)

    def pool_keys(self, source: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pools[source].keys.read(rows, dtype)

    def gather_pool(self, source: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.pools[source].kv.gather(rows, dtype)
