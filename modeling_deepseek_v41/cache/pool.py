"""A KV source's pool in a cache (packed FP4 rows, index keys, the ratio-r carry and the raw recent tokens a crop
rebuilds it from), and the view of it that its owner's `write_pool` call returns (`StoredPoolView`)."""

from __future__ import annotations

import torch

from ..kernels.dispatch import kernel_path
from ..kernels.gpu_linear import triton_kernels
from ..kernels.index_scores import StoredKeys
from ..kernels.sparse_attention import StoredPool
from ..layers.kv_store import PoolChunk
from .packed_rows import PackedRows, latest_positions, scatter_rows_where


class Pool:
    """One KV source's compressed rows and index keys, plus its raw recent tokens for restoring a carry. A `fixed`
    pool (static decode) keeps its capacity and its carry's buffers: each step reads every reserved row (those not
    written yet are masked by each query's visible count) and updates the carry in place."""

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
        self.fixed = False

    def rows_after(self, chunk_max_length: int) -> int:
        """Rows the longest batch row will have completed once the chunk is written (a fixed pool: all)."""
        return self.kv.capacity if self.fixed else chunk_max_length // self.ratio

    def fix(self, columns: int) -> None:
        """Reserve exactly the rows of `columns` columns (every step reads them all) and keep every buffer where it
        is (static decode)."""
        self.kv.resize(columns // self.ratio + 1)
        self.keys.resize(columns // self.ratio + 1)
        self.fixed = True

    def unfix(self) -> None:
        self.fixed = False

    def write(self, chunk: PoolChunk, positions: torch.Tensor, total: int) -> StoredPoolView:
        """Store the chunk's completed rows (codes and scales of their QDQ), the new carry and the raw tokens at
        `positions` [B,S]; returns the view of the pool's first `total` rows."""
        out, kv, keys = chunk.compressed, chunk.kv_codes, chunk.key_codes
        self.kv.ensure_capacity(max(total, 1))  # a step's skipped writes land on row 0
        self.keys.ensure_capacity(max(total, 1))
        if self.fixed or (out.rows.shape[1] == 1 and positions.shape[1] == 1):
            self._write_without_reads(out.rows, kv, keys, out.carry, out.token_kv, out.token_score, positions)
            return StoredPoolView(self, total)
        done = out.rows >= 0  # the chunk's completed rows, written with nothing read back to the host
        self.kv.write_codes_where(out.rows, kv[0], kv[1], done)
        self.keys.write_codes_where(out.rows, keys[0], keys[1], done)
        if self.ratio > 1:
            self.carry = out.carry
            kept, slot = latest_positions(positions, self.recent_size), positions % self.recent_size
            scatter_rows_where(self.recent_kv, slot, out.token_kv.to(self.recent_kv.dtype), kept)
            scatter_rows_where(self.recent_score, slot, out.token_score.to(self.recent_score.dtype), kept)
        return StoredPoolView(self, total)

    def _write_without_reads(self, rows: torch.Tensor, kv, keys, carry, token_kv, token_score,
                             positions: torch.Tensor) -> None:
        """write with fixed shapes and nothing read back (a step, or any chunk of a fixed pool): one scatter per
        possible row [B,G] and per token [B,S], each writing at most one entry per batch row (on CUDA one launch)."""
        if kernel_path(kv[0]) and self._one_launch():
            ratio = self.ratio > 1
            triton_kernels().pool_step_write(
                rows, kv, keys, (self.kv.codes, self.kv.scales), (self.keys.codes, self.keys.scales),
                (token_kv, token_score) if ratio else None, positions,
                (self.recent_kv, self.recent_score) if ratio else None, carry if ratio and self.fixed else None,
                self.carry if ratio and self.fixed else None)
            if ratio and not self.fixed:
                self.carry = carry
            return
        done = rows >= 0
        for g in range(rows.shape[1]):
            self.kv.write_codes_one_per_row(rows[:, g], kv[0][:, g], kv[1][:, g], done[:, g])
            self.keys.write_codes_one_per_row(rows[:, g], keys[0][:, g], keys[1][:, g], done[:, g])
        if self.ratio > 1:
            if self.fixed:  # in place: a replayed graph reads the carry where it wrote it
                for stored, new in zip(self.carry, carry):
                    stored.copy_(new)
            else:
                self.carry = carry
            for s in range(positions.shape[1]):
                live = (positions[:, s] >= 0).view(-1, 1, 1)
                index = (positions[:, s] % self.recent_size).view(-1, 1, 1).expand(-1, 1, self.recent_kv.shape[-1])
                for store, values in ((self.recent_kv, token_kv), (self.recent_score, token_score)):
                    new = values[:, s:s + 1].to(store.dtype)
                    store.scatter_(1, index, torch.where(live, new, store.gather(1, index)))

    def _one_launch(self) -> bool:
        """Whether the step's writes fit the one-launch kernel: power-of-two row widths, the carry's buffers (a
        fixed pool) contiguous."""
        widths = (self.kv.codes.shape[-1], self.kv.scales.shape[-1], self.keys.codes.shape[-1],
                  self.keys.scales.shape[-1], self.ratio * self.kv.codes.shape[-1] * 2)
        if any(w & (w - 1) for w in widths):
            return False
        return self.ratio == 1 or not self.fixed or all(t.is_contiguous() for t in self.carry)

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

    def crop(self, lengths: torch.Tensor) -> None:
        """Back to `lengths` tokens per row: rows past them are never read again; the carry is rebuilt."""
        if self.ratio > 1 and self.fixed:  # in place: a replayed graph reads the carry where it wrote it
            for stored, rebuilt in zip(self.carry, self.carry_at(lengths)):
                stored.copy_(rebuilt)
        elif self.ratio > 1:
            self.carry = self.carry_at(lengths)

    def select(self, indices: torch.Tensor) -> None:
        self.kv.select_batch(indices)
        self.keys.select_batch(indices)
        if self.ratio > 1:
            self.recent_kv = self.recent_kv.index_select(0, indices)
            self.recent_score = self.recent_score.index_select(0, indices)
            if self.carry is not None:
                self.carry = tuple(t.index_select(0, indices) for t in self.carry)

    def nbytes(self, lengths: torch.Tensor) -> tuple[int, int]:
        """(global KV bytes of the rows `lengths` tokens completed, bytes of the carry and the raw recent tokens)."""
        rows = int((lengths // self.ratio).sum())
        carry = 0
        if self.ratio > 1:
            carry = self.recent_kv.nbytes + self.recent_score.nbytes
            carry += sum(t.nbytes for t in self.carry) if self.carry is not None else 0
        return rows * (self.kv.bytes_per_row + self.keys.bytes_per_row), carry

    def saved(self, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a saved prefix keeps of this pool: the packed rows and keys `lengths` completed, and the carry."""
        rows = int((lengths // self.ratio).amax())
        tensors = {"kv_codes": self.kv.codes[:, :rows], "kv_scales": self.kv.scales[:, :rows],
                   "key_codes": self.keys.codes[:, :rows], "key_scales": self.keys.scales[:, :rows]}
        if self.ratio > 1:
            carry = self.carry_at(lengths) if self.carry is None else self.carry
            tensors["carry_kv"], tensors["carry_score"] = carry
        return {name: t.contiguous() for name, t in tensors.items()}

    def restore(self, saved: dict[str, torch.Tensor], lengths: torch.Tensor) -> None:
        """Fill this (new) pool from `saved` (as `saved` gives it, on this pool's device)."""
        rows = saved["kv_codes"].shape[1]
        for storage, kind in ((self.kv, "kv"), (self.keys, "key")):
            storage.ensure_capacity(rows)
            storage.codes[:, :rows] = saved[f"{kind}_codes"]
            storage.scales[:, :rows] = saved[f"{kind}_scales"]
        if self.ratio > 1:
            self.carry = (saved["carry_kv"], saved["carry_score"])
            # the carry's tokens also seed the raw history a later crop rebuilds carries from
            group_start = (lengths // self.ratio) * self.ratio
            for slot in range(self.ratio):
                present = group_start + slot < lengths
                index = ((group_start + slot) % self.recent_size)[present]
                self.recent_kv[present, index] = self.carry[0][present, slot].to(self.recent_kv.dtype)
                self.recent_score[present, index] = self.carry[1][present, slot].to(self.recent_score.dtype)


class StoredPoolView:
    """A cache's pool as one forward sees it: its first `rows` rows (a fixed pool: all it reserved)."""

    decodes_incrementally = True  # steps of a few tokens over stored rows: the indexers may gather candidates

    def __init__(self, pool: Pool, rows: int) -> None:
        self.pool, self.rows = pool, rows
        self.stored = StoredPool(pool.kv.codes, pool.kv.scales)

    def keys(self) -> StoredKeys:
        # packed: the scoring ops decode the rows they read (a decode step's candidates, not the whole pool)
        return StoredKeys(self.pool.keys.codes, self.pool.keys.scales, self.rows)

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.pool.kv.gather(rows, dtype)
