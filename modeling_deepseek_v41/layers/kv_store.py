"""The store protocol: what the layers call in the store of a forward. `cache/` implements it twice: a forward
with a cache runs on the cache's `CacheStore` (made per forward over the cache's pools and rings), a forward
without one on the throw-away `ChunkStore` (one attention path with or without a cache). It is declared here,
beside its callers, because the layers may not import `cache/` (imports go only downward).

Per layer and forward, at most two calls:
- a pool owner (the Full role) hands its compress step to `write_pool` and gets back a `PoolView` of the pool as
  this forward sees it (index keys, gathered rows, the packed rows); the layers reading that pool use the view;
- every attention layer calls `window` once: its chunk's window KV is written, and the `WindowView` lists each
  query's window entries (and, for a decode-sized chunk on a cache, carries the ring that holds them all).
The DSpark drafter feeds and reads its stages' rings in the cache itself (`DrafterRings`, with `dspark=True`).

Fixed-capacity (static) buffers are a property of the store's objects: no layer asks whether a cache is static.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..kernels.index_scores import StoredKeys
from ..kernels.sparse_attention import StoredPool, StoredWindow
from .compressor import CompressorOutput

Carry = tuple[torch.Tensor, torch.Tensor]  # (kv, score) [B, r, hd] of each row's open ratio-r group


class PoolChunk(NamedTuple):
    """A compress step's new pool rows for one chunk, as its store receives them."""

    compressed: CompressorOutput  # pool row ids, the new carry, the chunk's raw per-token projections
    rotated: torch.Tensor  # [B, G, hd] the rows' RoPE'd latents before FP4
    kv_codes: tuple[torch.Tensor, torch.Tensor]  # their FP4 (codes, E4M3 scales)
    keys: torch.Tensor  # [B, G, index_head_dim] their index keys before FP4
    key_codes: tuple[torch.Tensor, torch.Tensor]  # the keys' FP4 (codes, E8M0 scales)


# (positions still to pool [B,S] (-1 elsewhere), the pool's carry or None, whether to emit as many groups as the
# chunk's width could span, so that nothing is read back from the device) -> the chunk's new rows
CompressStep = Callable[[torch.Tensor, Carry | None, bool], PoolChunk]


@runtime_checkable
class PoolView(Protocol):
    """A pool as one forward sees it, once its owner wrote the chunk's rows: every row visible to this forward."""

    decodes_incrementally: bool  # steps of a few tokens over stored rows: the indexers may gather candidates
    stored: StoredPool | None  # the packed rows for the fused decode attention (a cache), else None

    def keys(self) -> torch.Tensor | StoredKeys:
        """Index keys of every visible row: values [B, N, index_head_dim], or a cache's packed keys (the scoring
        ops decode the rows they read)."""

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [B, ...] (valid ids) -> their KV [B, ..., hd] in `dtype`."""


@runtime_checkable
class WindowView(Protocol):
    """A layer's sliding window for the queries of one chunk, after the chunk's KV was written."""

    stored: StoredWindow | None  # a ring holding every entry (a cache's, or on CUDA a long chunk's spanning one)

    def entries(self, queries: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Window entries [B, q, L, hd] (oldest first) and validity [B, q, L] of the chunk's queries `queries`."""


@runtime_checkable
class KVStore(Protocol):
    """The two calls of an attention layer into its store."""

    def write_pool(self, source: int, positions: torch.Tensor, compress: CompressStep, dtype: torch.dtype
                   ) -> PoolView:
        """Run `compress` on what the pool `source` still needs from the chunk at `positions`, store its rows and
        return the pool's view (its keys read in `dtype`)."""

    def window(self, layer_id: int, kv: torch.Tensor, positions: torch.Tensor, size: int,
               floor: torch.Tensor | None = None) -> WindowView:
        """Write the chunk's window KV [B,S,hd] at `positions` and list the queries' windows of `size` positions;
        `floor` [B], when given, hides positions below it (windows cut to CED's replayed segment)."""


@runtime_checkable
class DrafterRings(Protocol):
    """The DSpark drafter's window rings in a cache made with `dspark=True`."""

    def write_window(self, layer_id: int, kv: torch.Tensor, positions: torch.Tensor) -> None:
        """Feed stage `layer_id`'s ring with the window KV [B,T,hd] of backbone positions [B,T]."""

    def drafter_window(self, layer_id: int, last: torch.Tensor, window: int, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's window up to position `last` [B]: values [B, L, hd] and validity [B, L]."""


@runtime_checkable
class ForwardStore(KVStore, Protocol):
    """What a forward calls around its layers (the chunk's bookkeeping), and the layers' store."""

    @property
    def no_host_reads(self) -> bool:
        """Whether this forward must not read device values back (a CUDA-graph step, or a traced one)."""

    def get_seq_length(self) -> int:
        """Input columns stored before this forward."""

    def begin_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, compute_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(the ids to run, their positions or None, how many leading replayed tokens were prepended)."""

    def append_history(self, compressed: torch.Tensor, replayed: int = 0) -> torch.Tensor:
        """Record the chunk's compressed ids; returns the n-gram context: earlier columns, then the chunk."""

    def commit(self, input_ids: torch.Tensor, positions: torch.Tensor, replayed: int = 0) -> None:
        """Account the chunk once every layer ran."""
