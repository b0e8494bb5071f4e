"""One forward's store over a DeepseekV41Cache: the store protocol (`layers/kv_store.py`) on the cache's parts.
Made for each forward, like the cache-less `ChunkStore`; what it holds itself lives one forward."""

from __future__ import annotations

import torch

from ..kernels.dispatch import kernel_path
from ..layers.kv_store import CompressStep
from .chunk import check_static_step, chunk_positions
from .pool import StoredPoolView
from .ring import RingWindow


class CacheStore:
    """The store of a forward with a cache: it begins the chunk (positions, the replay of a restored cache), hands
    the layers the cache's pools and rings, and commits the chunk to the cache."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.chunk_start: torch.Tensor | None = None  # [B] first position of the chunk
        self.chunk_max_length = 0  # the most real tokens a row holds once the chunk is committed

    # -- the forward's bookkeeping --------------------------------------------------------------------------------
    @property
    def no_host_reads(self) -> bool:
        """A static step (a CUDA graph replays it) or a traced one reads nothing back from the device."""
        return self.cache.is_static or torch.compiler.is_compiling()

    def get_seq_length(self) -> int:
        return self.cache.columns

    def begin_chunk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Start a forward over `input_ids`: returns (the ids to run, their positions [B, S'] with -1 at padding,
        how many leading replayed tokens were prepended). A cache restored from disk first replays its last
        `sliding_window` tokens, which rebuild the windows and never rewrite the pools."""
        cache, (batch, seq) = self.cache, input_ids.shape
        cache.prepare_rows(batch, input_ids.device, compute_dtype)
        if cache.is_static:
            check_static_step(seq, attention_mask, cache.pending_replay, cache.columns, cache.log.limit,
                              cache.crop_horizon + 1)
        positions, widest = chunk_positions(cache.lengths, cache.columns, seq, attention_mask)
        self.chunk_max_length = cache.max_length + seq if widest is None else widest
        replayed = 0
        if cache.pending_replay:
            replayed = min(cache.text_config.sliding_window, cache.columns)
            old_ids, old_positions = cache.log.replay(replayed)
            input_ids, positions = torch.cat([old_ids, input_ids], dim=1), torch.cat([old_positions, positions], 1)
            cache.pending_replay = False
        big = torch.iinfo(positions.dtype).max
        self.chunk_start = torch.where(positions >= 0, positions, big).amin(dim=1)
        return input_ids, positions, replayed

    def append_history(self, compressed: torch.Tensor, replayed: int = 0) -> torch.Tensor:
        """Append the chunk's compressed ids (replayed ones are already there); returns the last `max_ngram - 1`
        earlier columns followed by the whole chunk."""
        keep = self.cache.text_config.engram_max_ngram_size - 1
        return self.cache.log.append_history(compressed, replayed, keep)

    def commit(self, input_ids: torch.Tensor, positions: torch.Tensor, replayed: int = 0) -> None:
        """Account the chunk (its non-replayed part): tokens, real columns, column and per-row token counts."""
        self.cache.log.append(input_ids[:, replayed:], positions[:, replayed:] >= 0, self.chunk_max_length)

    # -- the layers' calls ----------------------------------------------------------------------------------------
    def write_pool(self, source: int, positions: torch.Tensor, compress: CompressStep, dtype: torch.dtype
                   ) -> StoredPoolView:
        pool = self.cache.pools[source]
        positions = torch.where(positions >= self.cache.lengths.unsqueeze(1), positions, -1)  # a replay's: pooled
        # a row per group the chunk could span: the pool drops the unused ones without a device read
        chunk = compress(positions, pool.carry, True)
        return pool.write(chunk, positions, pool.rows_after(self.chunk_max_length))

    def window(self, layer_id: int, kv: torch.Tensor, positions: torch.Tensor, size: int,
               floor: torch.Tensor | None = None) -> RingWindow:
        ring = self.cache.rings[layer_id]
        widest = ring.width(size, self.chunk_max_length)
        if ring.holds_chunk(kv.shape[1], size):
            listed = fused = ring
        elif kernel_path(kv):  # the fused attention lists a long chunk's windows from one ring wide enough
            listed = fused = ring.spanning(kv, positions, self.chunk_start)
        else:  # a longer chunk overwrites slots its first queries list: they read a copy of the ring as it was
            listed, fused = ring.snapshot(), None
        ring.write(kv, positions)
        stored = fused.stored(widest) if fused is not None else None
        return RingWindow(listed, kv, positions, size, floor, self.chunk_start, widest, stored)
