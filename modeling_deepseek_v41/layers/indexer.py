"""The CSA2 indexer: FP4 query heads score pool rows through their FP4 index keys and keep the top-k rows."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fp4_rows import rotated_fp4_qdq, rotated_fp4_rows
from ..kernels.index_scores import candidate_scores, index_scores, key_rows
from ..kernels.numerics import INDEX_BLOCK
from ..kernels.sparse_attention import candidate_mask, select_candidate_blocks, topk_ascending
from .kv_store import PoolView
from .linear import DeepseekV41Linear, DeepseekV41RMSNorm

QUERY_CHUNK = 1024  # queries scored per step of a long prefill
GATHER_MAX_QUERIES = 64  # up to this many queries, Reindex layers score only their candidate blocks


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The query chunks' results along the sequence (a decode step's one chunk as it is: no copy)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


class DeepseekV41Indexer(nn.Module):
    """score[s, t] = sum_h relu(q[s,h] . k[t]) * w[s,h], in bf16 like the reference (so ties are exact).

    Owners of a pool (`owns_keys`) also project the pool's latents to index keys. After the candidate source,
    scoring is restricted to its candidate blocks.
    """

    def __init__(self, config, spec, quantized: bool) -> None:
        super().__init__()
        self.spec = spec
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.candidate_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.wq_b = DeepseekV41Linear(config.q_lora_rank, self.n_heads * self.head_dim,
                                      storage="fp8" if quantized else "dense")
        self.weights_proj = DeepseekV41Linear(config.hidden_size, self.n_heads)
        if spec.owns_index_keys:
            self.wk = DeepseekV41Linear(config.head_dim, self.head_dim)
            self.k_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys(self, latents: torch.Tensor, rotation: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Index keys of new pool rows from their pre-RoPE latents (rotation at each row's first token): the keys
        before FP4 and their FP4 (codes, scales). The store decides what to keep: the packed codes (a cache) or
        their values (a cache-less forward)."""
        return rotated_fp4_rows(self.k_norm(self.wk(latents)), rotation, self.rope_dim, INDEX_BLOCK, "e8m0")

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rotation: torch.Tensor, pool: PoolView,
                visible: torch.Tensor, share) -> torch.Tensor:
        """x [B,S,D] normed input; qr [B,S,q_lora]; `pool` the view of the pool scored (its keys
        [B,N,index_head_dim]); visible [B,S] rows each query may see. Returns selected pool rows [B,S,k]
        ascending, -1 where nothing visible is left to select."""
        keys = pool.keys()  # values, or a cache's packed keys (the scoring ops decode what they read)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotated_fp4_qdq(q, rotation, self.rope_dim, INDEX_BLOCK, "e8m0")
        weights = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        k = min(self.topk, key_rows(keys))
        # decode-sized steps gather their candidate blocks' keys (cost independent of the pool length); prefills
        # and short pools score every row once, which is cheaper there
        gathered = (self.spec.uses_candidates and pool.decodes_incrementally and self._candidates_cover_topk()
                    and q.shape[1] <= GATHER_MAX_QUERIES)
        selections, candidates, recorded = [], [], []
        for start in range(0, q.shape[1], QUERY_CHUNK):  # bounded score tensors for long prefills
            queries = slice(start, start + QUERY_CHUNK)
            if gathered:
                selections.append(self._select_in_candidates(
                    q[:, queries], weights[:, queries], keys, visible[:, queries], share.candidates[:, queries], k))
                continue
            scores = index_scores(q[:, queries], weights[:, queries], keys, visible[:, queries])
            if self.spec.is_candidate_source:
                candidates.append(select_candidate_blocks(scores, visible[:, queries], self.candidate_blocks,
                                                          self.candidate_block_size))
            elif self.spec.uses_candidates:
                mask = candidate_mask(share.candidates[:, queries], self.candidate_block_size, key_rows(keys))
                scores = scores.masked_fill(~mask, -torch.inf)
            recorded.append(scores)
            picked = topk_ascending(scores, k)
            selections.append(torch.where(picked < visible[:, queries].unsqueeze(-1), picked, -1))
        if self.spec.is_candidate_source:
            share.candidates = _joined(candidates)
        if share.record_selection and recorded:
            share.index_scores[self.spec.layer_id] = _joined(recorded)
            if self.spec.is_candidate_source:
                share.candidate_history[self.spec.layer_id] = share.candidates
        return _joined(selections)

    def _candidates_cover_topk(self) -> bool:
        """Whether every query always has at least top-k reachable candidates once it has top-k visible rows, so
        scoring only inside the candidate blocks selects what the dense masked scoring selects."""
        return (self.candidate_blocks - 1) * self.candidate_block_size + 1 >= self.topk

    def _select_in_candidates(self, q: torch.Tensor, weights: torch.Tensor, keys, visible: torch.Tensor,
                              blocks: torch.Tensor, k: int) -> torch.Tensor:
        """Score only the candidate blocks' keys per query (decode cost independent of the pool length); ties still
        go to the earlier position because candidates are listed in position order."""
        scores, positions = candidate_scores(q, weights, keys, visible, blocks, self.candidate_block_size)
        batch, seq, width = positions.shape
        # candidates are in position order, so the chosen ones' positions are ascending too
        chosen = topk_ascending(scores, min(k, width), drop_unreachable=True)
        picked = torch.where(chosen >= 0, positions.gather(-1, chosen.clamp_min(0)), -1)
        if picked.shape[-1] < k:
            picked = torch.cat([picked, picked.new_full((batch, seq, k - picked.shape[-1]), -1)], dim=-1)
        return picked
