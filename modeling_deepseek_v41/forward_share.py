"""What CSA2 layers hand down the stack within one forward: pools, index keys, selections, candidates.

Owned by the model's forward (never module-level), so two models, threads and torch.compile are safe. Every slot
is keyed by the layer that wrote it and read by the layers the layer plan names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardShare:
    """Per-forward CSA2 state. Pools and keys hold every row visible to this forward (cached and new)."""

    pool_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # source -> [B, N, head_dim] (no cache only)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # source -> [B, N, index_head_dim]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [B, S, k] pool rows, -1 = none
    candidates: torch.Tensor | None = None  # [B, S, N] bool, published by the candidate source
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # filled only when recording
    record_selection: bool = False  # keep scores and candidates of every index source (tests, inspection)
    candidate_history: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: object | None = None  # a DeepseekV41Cache when decoding incrementally
    pool_ready: set[int] = field(default_factory=set)  # pool owners whose rows this forward already wrote
    window_floor: torch.Tensor | None = None  # [B] lowest position a window may list (bounded replay)
