"""DeepseekV41Cache: the shared CSA2 pools (packed FP4 KV and index keys), per-layer FP8 window rings, ratio-r
carries and the Engram token history, with crop, beam reordering and byte accounting."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .fingerprint import CACHE_SHAPE_FIELDS
from .kv_access import KVAccessMixin
from .layer_view import DeepseekV41LayerView
from .static import StaticDecodeMixin
from .storage import Columns, Pool, Ring
from .persistence import load_cache, save_cache
from .row_indices import check_row_indices
from ..config.layer_plan import LayerPlan
from ..kernels.numerics import compute_dtype

DEFAULT_CROP_HORIZON = 64


class DeepseekV41Cache(KVAccessMixin, StaticDecodeMixin, Cache):
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
        self.text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        # one view per backbone layer: generate() reads len(cache) and the layers' kinds (attention, not recurrent)
        super().__init__(layers=[DeepseekV41LayerView(self, i) for i in range(self.text_config.num_hidden_layers)])
        self.dspark = dspark  # feed the DSpark drafter's rings from every processed position
        self.plan = LayerPlan.from_config(self.text_config)
        self.crop_horizon = crop_horizon
        self.config_signature = self.signature_of(self.text_config)
        self.generation_run = None  # the helpers of the generate() call using this cache, while it runs
        self.reset()

    @staticmethod
    def signature_of(text_config) -> tuple:
        """What a cache must agree on with the model that uses it."""
        return tuple((k, str(getattr(text_config, k))) for k in CACHE_SHAPE_FIELDS)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.columns = 0
        self.lengths = None  # [B] real tokens per row
        self.chunk_max_length = 0  # max real tokens of a row once the chunk in progress is committed
        self.pools: dict[int, Pool] = {}
        self.rings: dict[int, Ring] = {}
        self._history: Columns | None = None  # compressed ids per column (DEAD for images and padding)
        self._real: Columns | None = None  # True where a column is a real token (not padding)
        self._tokens: Columns | None = None  # the raw token id of every column
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

    def _allocate(self, batch: int, device: torch.device, model_dtype: torch.dtype) -> None:
        text = self.text_config
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._history = Columns(batch, torch.long, device)
        self._real = Columns(batch, torch.bool, device)
        self._tokens = Columns(batch, torch.long, device)
        self.compute_dtype = model_dtype
        # the compressor's projections are fp32 (float64 for a float64 model): keep them in that precision
        projection_dtype = compute_dtype(model_dtype)
        ring_size = text.sliding_window + self.crop_horizon
        for spec in self.plan.layers + (self.plan.dspark_layers if self.dspark else ()):
            self.rings[spec.layer_id] = Ring(ring_size, text.head_dim, batch, device)
            if spec.owns_pool:
                self.pools[spec.layer_id] = Pool(spec.ratio, text.head_dim, text.index_head_dim, batch,
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

    # -- transformers' Cache API (its per-layer queries are answered by the layer views) --------------------
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
                pool.carry = pool.carry_at(self.lengths)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices, validate=True)

    def _select_rows(self, indices: torch.Tensor, validate: bool) -> None:
        """Keep (and reorder, repeat) the rows `indices` of every tensor the cache holds; `validate` checks the
        caller's indices first (one host read)."""
        if not self.is_initialized:
            return
        if self.is_static:
            raise ValueError("Cannot reorder a static cache's rows; call cache.end_static() first.")
        if validate:
            check_row_indices(indices, self.lengths.shape[0])
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
        if self.is_initialized:  # indices built here are valid by construction: no check, no host read
            self._select_rows(torch.arange(self.lengths.shape[0]).repeat_interleave(repeats), validate=False)

    # -- persistence ----------------------------------------------------------------------------------------
    def save(self, path, model) -> "Path":
        """Save the prefix (global KV, carries, Engram history, token ids) to `path`, atomically."""
        return save_cache(self, path, model)

    @classmethod
    def load(cls, path, model, dspark: bool = False, crop_horizon: int | None = None) -> "DeepseekV41Cache":
        """Restore a saved prefix for `model`; its next forward first replays the last `sliding_window` tokens to
        rebuild the windows (bounded replay), then runs the new tokens."""
        return load_cache(cls, path, model, dspark=dspark, crop_horizon=crop_horizon or DEFAULT_CROP_HORIZON)

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
