"""What a cache checks and computes when a forward begins a chunk, and when static decode begins: the chunk's
positions from the per-row lengths and the attention mask, and the rules of a static (fixed-buffer) cache."""

from __future__ import annotations

import torch


def chunk_positions(lengths: torch.Tensor, columns: int, seq: int, attention_mask: torch.Tensor | None
                    ) -> tuple[torch.Tensor, int | None]:
    """(positions [B, seq] of the chunk, -1 at padding; the most real tokens a row holds after it when the mask
    decides it, else None: the caller adds `seq` to the count it knows on the host)."""
    if attention_mask is None:
        return lengths.unsqueeze(1) + torch.arange(seq, device=lengths.device), None
    if attention_mask.shape[1] not in (seq, columns + seq):
        raise ValueError(f"attention_mask covers {attention_mask.shape[1]} columns; expected the chunk ({seq}) or "
                         f"the cache plus the chunk ({columns + seq}).")
    chunk = attention_mask[:, -seq:].to(torch.bool)
    positions = torch.where(chunk, lengths.unsqueeze(1) + chunk.long().cumsum(-1) - 1, -1)
    # the step's one device read: every pool and window width of this forward follows from it
    return positions, int((lengths + chunk.sum(dim=1)).amax())


def check_static_step(seq: int, attention_mask: torch.Tensor | None, pending_replay: bool, columns: int,
                      limit: int, widest: int) -> None:
    """A static cache runs steps of 1 to `widest` tokens (a DSpark verify step: the drafts and the token before
    them) without a mask, within the columns it was fixed for."""
    if not 1 <= seq <= widest or attention_mask is not None or pending_replay:
        raise ValueError(f"A static cache (make_static) runs decode steps of 1 to {widest} tokens without an "
                         "attention mask; call cache.end_static() before other forwards.")
    if columns + seq > limit:
        raise ValueError(f"This static cache has room for {limit - columns} more columns, not {seq}; call "
                         "cache.end_static() or make_static with more columns.")


def check_make_static(cache, columns: int) -> None:
    """Refuse `cache.make_static(columns)` before anything is fixed, naming the fix."""
    keep = cache.text_config.engram_max_ngram_size - 1  # a step's n-grams read this many earlier columns
    if not cache.is_initialized or cache.columns < max(keep, 1):
        raise ValueError(f"make_static needs a prefilled cache of at least {max(keep, 1)} columns: run the "
                         "prompt through the model first.")
    if cache.pending_replay:
        raise ValueError("make_static needs a cache without a pending replay (run one forward after loading a "
                         "saved cache).")
    if columns <= cache.columns:
        raise ValueError(f"make_static({columns}): the cache already holds {cache.columns} columns.")
    if any(pool.ratio > 1 and pool.carry is None for pool in cache.pools.values()):
        raise ValueError("make_static needs every pool's carry: prefill at least one token.")


def check_crop(count: int, horizon: int, columns: int, floor: int, static_start: int | None) -> None:
    """Refuse cropping `count` columns that cannot be rolled back exactly (a static cache: in place, back to where
    it was fixed at most)."""
    if static_start is not None and count > columns - static_start:
        raise ValueError(f"Cannot crop {count} tokens from a static cache fixed at {static_start} of its {columns} "
                         "columns: it crops only its own steps. Call cache.end_static() first.")
    if count > horizon:
        raise ValueError(f"Cannot crop {count} tokens: this cache keeps {horizon} tokens of history to roll back "
                         "exactly (crop_horizon). Create it with a larger crop_horizon.")
    if count > columns - floor:
        raise ValueError(f"Cannot crop {count} tokens from a cache holding {columns} ({floor} of them restored "
                         "from disk, which cannot be rolled back).")
