"""DeepseekV41Cache: the shared CSA2 pools (packed FP4 KV and index keys), per-layer FP8 window rings, ratio-r
carries and the Engram token history, with crop, beam reordering and byte accounting."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .kv_storage import PackedRows
from .layer_plan import LayerPlan

DEFAULT_CROP_HORIZON = 64


class _Pool:
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


class _Columns:
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


class _Ring:
    """A layer's window KV: FP8 rows in `size` slots indexed by position modulo size, with each slot's position."""

    def __init__(self, size: int, head_dim: int, batch: int, device: torch.device) -> None:
        self.size = size
        self.rows = PackedRows("fp8_e8m0", batch, head_dim, size, device)
        self.positions = torch.full((batch, size), -1, dtype=torch.long, device=device)


class DeepseekV41Cache(Cache):
    """The state DeepSeek-V4.1 carries between forward calls.

    - per KV source (a "Full" layer): the compressed KV rows (E2M1 + E4M3 scale per 16: 288 bytes per 512-wide
      row), the index keys (E2M1 + E8M0 per 32: 68 bytes per 128-wide row), and for ratio r > 1 the fp32 carry of
      the incomplete group;
    - with `dspark=True`, each drafter stage's window ring, fed from the backbone taps of every processed position;
    - per layer (backbone and DSpark blocks): an FP8 window ring (e4m3 + E8M0 per 32: 528 bytes per slot) of
      `sliding_window + crop_horizon` slots, so the cache can be cropped back that far exactly;
    - the Engram compressed-token history.

    Positions are per batch row (left padding shifts them); `get_seq_length()` counts input columns, padding
    included, as `generate()` expects. Create it directly or let `generate()` do it.
    """

    def __init__(self, config, crop_horizon: int = DEFAULT_CROP_HORIZON, dspark: bool = False) -> None:
        super().__init__(layers=[])
        self.dspark = dspark  # feed the DSpark drafter's rings from every processed position
        self.text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.plan = LayerPlan.from_config(self.text_config)
        self.crop_horizon = crop_horizon
        self.config_signature = self.signature_of(self.text_config)
        self.reset()

    @staticmethod
    def signature_of(text_config) -> tuple:
        """What a cache must agree on with the model that uses it."""
        keys = ("hidden_size", "head_dim", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
                "index_source_layer_ids", "sliding_window", "index_head_dim", "engram_layer_ids", "vocab_size")
        return tuple((k, str(getattr(text_config, k))) for k in keys)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.columns = 0
        self.lengths = None  # [B] real tokens per row
        self.chunk_max_length = 0  # max real tokens of a row once the chunk in progress is committed
        self.pools: dict[int, _Pool] = {}
        self.rings: dict[int, _Ring] = {}
        self._history: _Columns | None = None  # compressed ids per column (DEAD for images and padding)
        self._real: _Columns | None = None  # True where a column is a real token (not padding)
        self._tokens: _Columns | None = None  # the raw token id of every column
        self.chunk_start: torch.Tensor | None = None  # [B] first position of the chunk being processed
        self.pending_replay = False  # a restored cache replays its last window of tokens on the next forward
        self.crop_floor = 0  # a restored cache cannot roll back past its restore point
        self.compute_dtype: torch.dtype | None = None
        self.static_columns: torch.Tensor | None = None  # [1, 1] the column count on the device, in static mode
        self.static_limit = 0  # the columns a static cache has room for

    @property
    def lengths(self) -> torch.Tensor | None:
        """[B] real tokens per batch row."""
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor | None) -> None:
        self._lengths = value
        self._max_length = None  # read back from the tensor only if asked before the next commit sets it

    @property
    def max_length(self) -> int:
        """The most real tokens any row holds, as a Python int (decode steps know it without a device read)."""
        if self._max_length is None:
            self._max_length = int(self._lengths.amax()) if self._lengths is not None and self._lengths.numel() else 0
        return self._max_length

    @property
    def history(self) -> torch.Tensor:
        """[B, columns] compressed token ids of everything cached (DEAD at images and padding)."""
        return self._history.view(0, self.columns)

    @property
    def is_initialized(self) -> bool:
        return self.lengths is not None

    def check_compatible(self, text_config) -> None:
        if self.signature_of(text_config) != self.config_signature:
            raise ValueError(
                "This DeepseekV41Cache was built for a model with another configuration; create a new cache for "
                "this model (DeepseekV41Cache(model.config)) or pass cache=None."
            )

    def _allocate(self, batch: int, device: torch.device, compute_dtype: torch.dtype) -> None:
        text = self.text_config
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._history = _Columns(batch, torch.long, device)
        self._real = _Columns(batch, torch.bool, device)
        self._tokens = _Columns(batch, torch.long, device)
        self.compute_dtype = compute_dtype
        # the compressor's projections are fp32 (float64 for a float64 model): keep them in that precision
        projection_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        ring_size = text.sliding_window + self.crop_horizon
        for spec in self.plan.layers + (self.plan.dspark_layers if self.dspark else ()):
            self.rings[spec.layer_id] = _Ring(ring_size, text.head_dim, batch, device)
            if spec.owns_pool:
                self.pools[spec.layer_id] = _Pool(spec.ratio, text.head_dim, text.index_head_dim, batch,
                                                  self.crop_horizon, device, projection_dtype)

    # -- per-forward bookkeeping ------------------------------------------------------------------------------
    def begin_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Start a forward over `input_ids`: returns (the ids to run, their positions [B, S'] with -1 at padding,
        how many leading replayed tokens were prepended). A cache restored from disk first replays its last
        `sliding_window` tokens, which rebuild the windows and never rewrite the pools."""
        batch, seq = input_ids.shape
        if not self.is_initialized:
            self._allocate(batch, input_ids.device, compute_dtype)
        if self.lengths.shape[0] != batch:
            raise ValueError(f"The cache holds {self.lengths.shape[0]} rows but the input has {batch}.")
        if self.is_static and (seq != 1 or attention_mask is not None or self.pending_replay):
            raise ValueError("A static cache (make_static) runs one-token decode steps without an attention mask; "
                             "call cache.end_static() before other forwards.")
        if self.is_static and self.columns >= self.static_limit:
            raise ValueError(f"This static cache is full ({self.static_limit} columns); call cache.end_static() "
                             "or make_static with more columns.")
        if attention_mask is None:
            positions = self.lengths.unsqueeze(1) + torch.arange(seq, device=input_ids.device)
            self.chunk_max_length = self.max_length + seq
        elif attention_mask.shape[1] not in (seq, self.columns + seq):
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[1]} columns; expected the chunk ({seq}) or the cache "
                f"plus the chunk ({self.columns + seq})."
            )
        else:
            chunk = attention_mask[:, -seq:].to(torch.bool)
            positions = torch.where(chunk, self.lengths.unsqueeze(1) + chunk.long().cumsum(-1) - 1, -1)
            # the step's one device read: every pool and window width of this forward follows from it
            self.chunk_max_length = int((self.lengths + chunk.sum(dim=1)).amax())
        replayed = 0
        if self.pending_replay:
            replayed = min(self.text_config.sliding_window, self.columns)
            real = self._real.view(0, self.columns)
            old_positions = torch.where(real, real.long().cumsum(-1) - 1, -1)[:, self.columns - replayed:]
            input_ids = torch.cat([self._tokens.view(self.columns - replayed, self.columns), input_ids], dim=1)
            positions = torch.cat([old_positions, positions], dim=1)
            self.pending_replay = False
        live = positions >= 0
        big = torch.iinfo(positions.dtype).max
        self.chunk_start = torch.where(live, positions, big).amin(dim=1)
        return input_ids, positions, replayed

    def append_history(self, compressed: torch.Tensor, replayed: int = 0) -> torch.Tensor:
        """Append the chunk's compressed ids (replayed ones are already there); returns the last `max_ngram - 1`
        earlier columns followed by the whole chunk."""
        keep = self.text_config.engram_max_ngram_size - 1
        if self.is_static:  # the step's column is a device counter; the n-gram window is the last keep + 1 columns
            self._history.write_at(self.static_columns, compressed)
            window = self.static_columns - keep + torch.arange(keep + 1, device=compressed.device)
            return self._history.buffer.index_select(1, window.view(-1))
        self._history.write(self.columns, compressed[:, replayed:])
        new_end = self.columns + compressed.shape[1] - replayed
        return self._history.view(max(0, self.columns - replayed - keep), new_end)

    def commit(self, input_ids: torch.Tensor, positions: torch.Tensor, replayed: int = 0) -> None:
        """Account the chunk (its non-replayed part): tokens, real columns, column and per-row token counts."""
        new_ids, new_positions = input_ids[:, replayed:], positions[:, replayed:]
        if self.is_static:  # in place, so that a replayed CUDA graph advances the same buffers
            self._tokens.write_at(self.static_columns, new_ids)
            self._real.write_at(self.static_columns, new_positions >= 0)
            self.static_columns.add_(1)
            self._lengths.add_((new_positions >= 0).sum(dim=1))
            self.columns += 1
            self._max_length = self.chunk_max_length
            return
        self._tokens.write(self.columns, new_ids)
        self._real.write(self.columns, new_positions >= 0)
        self.columns += new_positions.shape[1]
        self.lengths = self.lengths + (new_positions >= 0).sum(dim=1)
        self._max_length = self.chunk_max_length

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
        p = positions.unsqueeze(-1)
        listed = (p - window + 1).clamp_min(0) + torch.arange(max(width, 0), device=positions.device)
        valid = (listed <= p) & (p >= 0)
        if floor is not None:
            valid = valid & (listed >= floor.view(-1, 1, 1))
        in_chunk = listed >= start
        chunk_index = offset + torch.arange(positions.shape[1], device=positions.device).view(1, -1, 1) - (p - listed)
        chunk_index = torch.where(valid & in_chunk, chunk_index, 0)
        ring_slot = torch.where(valid & ~in_chunk, listed % ring.size, 0)
        batch_ids = torch.arange(positions.shape[0], device=positions.device).view(-1, 1, 1)
        valid = valid & (in_chunk | (ring.positions[batch_ids, ring_slot] == listed))  # a ring slot may be empty
        from_chunk = _gather(chunk_kv, chunk_index)
        from_ring = ring.rows.gather(ring_slot, chunk_kv.dtype)
        entries = torch.where((valid & in_chunk).unsqueeze(-1), from_chunk, from_ring)
        return entries, valid

    def write_window(self, layer_id: int, chunk_kv: torch.Tensor, positions: torch.Tensor) -> None:
        ring = self.rings[layer_id]
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

    def _write_pool_step(self, pool: _Pool, rows: torch.Tensor, kv, keys, carry, token_kv, token_score,
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

    def pool_keys(self, source: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pools[source].keys.read(rows, dtype)

    def gather_pool(self, source: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.pools[source].kv.gather(rows, dtype)

    # -- static decode (CUDA graphs) --------------------------------------------------------------------------
    @property
    def is_static(self) -> bool:
        return self.static_columns is not None

    def make_static(self, columns: int) -> None:
        """Fix every buffer for one-token decode steps until the cache holds `columns` columns: each step then
        runs the same kernels on the same memory with the same shapes (what a CUDA graph replays). Pool reads span
        the pools' capacity, masked by each query's visible rows, so a step's cost no longer follows the context."""
        keep = self.text_config.engram_max_ngram_size - 1  # a step's n-grams read this many earlier columns
        if not self.is_initialized or self.columns < max(keep, 1):
            raise ValueError(f"make_static needs a prefilled cache of at least {max(keep, 1)} columns: run the "
                             "prompt through the model first.")
        if self.pending_replay or self.dspark:
            raise ValueError("make_static needs a cache without a pending replay and without DSpark rings "
                             "(run one forward after loading a saved cache; create the cache with dspark=False).")
        if columns <= self.columns:
            raise ValueError(f"make_static({columns}): the cache already holds {self.columns} columns.")
        for record in (self._history, self._real, self._tokens):
            record.reserve(columns)
        for pool in self.pools.values():
            pool.kv.ensure_capacity(columns // pool.ratio + 1)
            pool.keys.ensure_capacity(columns // pool.ratio + 1)
            if pool.ratio > 1 and pool.carry is None:
                raise ValueError("make_static needs every pool's carry: prefill at least one token.")
        self.chunk_max_length = self.max_length  # read back here, once: static steps advance it on the host
        self.static_columns = torch.full((1, 1), self.columns, dtype=torch.long, device=self.lengths.device)
        self.static_limit = columns

    def end_static(self) -> None:
        """Back to growing buffers (any forward is allowed again)."""
        self.static_columns = None

    def static_state(self) -> tuple[int, int | None, int]:
        """The host-side counters a static step advances (a graph replay does not run Python)."""
        return self.columns, self._max_length, self.chunk_max_length

    def set_static_state(self, state: tuple[int, int | None, int]) -> None:
        self.columns, self._max_length, self.chunk_max_length = state

    def advance_static_step(self) -> None:
        """What a static step's begin_chunk and commit do on the host, for a step replayed from a graph."""
        self.columns += 1
        self._max_length += 1
        self.chunk_max_length = self._max_length

    # -- Cache API ------------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return -1 if self.lengths is None else int(self.lengths.shape[0])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` columns (transformers' convention: a negative count; 0 is a no-op).

        Windows, carries, pools and histories return exactly to their earlier state within `crop_horizon`."""
        if tokens_to_remove > 0:
            raise ValueError("DeepseekV41Cache.crop takes a negative number of tokens to remove (or 0).")
        count = -tokens_to_remove
        if count == 0 or not self.is_initialized:
            return
        if self.is_static:
            raise ValueError("Cannot crop a static cache; call cache.end_static() first.")
        if count > self.crop_horizon:
            raise ValueError(
                f"Cannot crop {count} tokens: this cache keeps {self.crop_horizon} tokens of history to roll back "
                "exactly (crop_horizon). Create it with a larger crop_horizon."
            )
        if count > self.columns - self.crop_floor:
            raise ValueError(f"Cannot crop {count} tokens from a cache holding {self.columns} "
                             f"({self.crop_floor} of them restored from disk, which cannot be rolled back).")
        self.lengths = self.lengths - self._real.view(self.columns - count, self.columns).sum(dim=1)
        self.columns -= count
        for ring in self.rings.values():
            ring.positions = torch.where(ring.positions >= self.lengths.unsqueeze(1), -1, ring.positions)
        for pool in self.pools.values():
            if pool.ratio > 1:
                pool.carry = self._carry_at(pool, self.lengths)

    @staticmethod
    def _carry_at(pool: _Pool, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The carry after `lengths` tokens: slots of the open group's tokens, from the raw recent tokens."""
        r = pool.ratio
        group_start = (lengths // r) * r
        slots = torch.arange(r, device=lengths.device)
        token_pos = group_start.unsqueeze(1) + slots
        present = token_pos < lengths.unsqueeze(1)
        index = (token_pos % pool.recent_size).unsqueeze(-1).expand(-1, -1, pool.recent_kv.shape[-1])
        kv = torch.where(present.unsqueeze(-1), pool.recent_kv.gather(1, index), 0)
        score = torch.where(present.unsqueeze(-1), pool.recent_score.gather(1, index), -torch.inf)
        return kv, score

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        if self.is_static:
            raise ValueError("Cannot reorder a static cache's rows; call cache.end_static() first.")
        indices = indices.to(self.lengths.device)
        self.lengths = self.lengths.index_select(0, indices)
        self._history.select(indices)
        self._real.select(indices)
        self._tokens.select(indices)
        for ring in self.rings.values():
            ring.rows.select_batch(indices)
            ring.positions = ring.positions.index_select(0, indices)
        for pool in self.pools.values():
            pool.kv.select_batch(indices)
            pool.keys.select_batch(indices)
            if pool.ratio > 1:
                pool.recent_kv = pool.recent_kv.index_select(0, indices)
                pool.recent_score = pool.recent_score.index_select(0, indices)
                if pool.carry is not None:
                    pool.carry = tuple(t.index_select(0, indices) for t in pool.carry)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.lengths.shape[0]).repeat_interleave(repeats))

    # -- persistence ----------------------------------------------------------------------------------------
    def save(self, path, model) -> "Path":
        """Save the prefix (global KV, carries, Engram history, token ids) to `path`, atomically."""
        from .cache_persistence import save_cache

        return save_cache(self, path, model)

    @classmethod
    def load(cls, path, model, dspark: bool = False, crop_horizon: int | None = None) -> "DeepseekV41Cache":
        """Restore a saved prefix for `model`; its next forward first replays the last `sliding_window` tokens to
        rebuild the windows (bounded replay), then runs the new tokens."""
        from .cache_persistence import load_cache

        return load_cache(path, model, dspark=dspark, crop_horizon=crop_horizon)

    def check_extends(self, input_ids: torch.Tensor) -> None:
        """A restored prefix continues only with inputs that start with its saved tokens."""
        saved = self._tokens.view(0, self.columns)
        if input_ids.shape[1] < self.columns or not torch.equal(input_ids[:, : self.columns].to(saved.device), saved):
            raise ValueError(
                f"The input does not extend the restored prefix: its first {self.columns} tokens must equal the "
                "saved ones (pass the full sequence, prefix then suffix, to generate())."
            )

    # -- inspection -----------------------------------------------------------------------------------------
    def nbytes_by_component(self) -> dict[str, int]:
        """Bytes in use: the compressed pools and index keys (global KV), the window rings (as allocated), the
        carries and recent raw tokens kept for cropping, and the Engram history."""
        if not self.is_initialized:
            return {"global_kv": 0, "window": 0, "carry": 0, "engram_history": 0}
        batch = self.lengths.shape[0]
        global_kv = 0
        carry = 0
        for pool in self.pools.values():
            rows = int((self.lengths // pool.ratio).sum())
            global_kv += rows * (pool.kv.bytes_per_row + pool.keys.bytes_per_row)
            if pool.ratio > 1:
                carry += pool.recent_kv.nbytes + pool.recent_score.nbytes
                carry += sum(t.nbytes for t in pool.carry) if pool.carry is not None else 0
        window = sum(ring.rows.nbytes for ring in self.rings.values())
        return {"global_kv": global_kv, "window": window, "carry": carry,
                "engram_history": self.columns * batch * (self._history.buffer.element_size() + 1)}

    def global_bytes_per_token(self) -> float:
        """Global (compressed) KV bytes per token of a row, averaged over rows."""
        tokens = int(self.lengths.sum()) if self.is_initialized else 0
        return self.nbytes_by_component()["global_kv"] / max(tokens, 1)

    def __repr__(self) -> str:
        return (f"DeepseekV41Cache(columns={self.columns}, pools={sorted(self.pools)}, "
                f"rings={len(self.rings)}, bytes={self.nbytes_by_component()})")


def _gather(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    batch, s, k = index.shape
    flat = index.reshape(batch, s * k, 1).expand(-1, -1, source.shape[-1])
    return source.gather(1, flat).view(batch, s, k, source.shape[-1])
