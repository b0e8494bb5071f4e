"""CSA2 attention: a sliding window of FP8 KV plus, on compressed layers, the top-k rows of a shared pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..config.layer_plan import LayerSpec
from ..kernels.fp4_rows import rotated_fp4_rows
from ..kernels.numerics import POOL_KV_BLOCK, weight_dtype
from ..kernels.sparse_attention import attend_stored, sparse_attention, window_kv
from .compressor import DeepseekV41Compressor
from .indexer import QUERY_CHUNK, DeepseekV41Indexer  # queries attended per step: as many as are indexed
from .kv_store import Carry, ForwardStore, PoolChunk, PoolView
from .linear import DeepseekV41Linear, DeepseekV41RMSNorm, DeepseekV41Weight, linear_pair
from .rotary import apply_rope_tail, rope_angles


@dataclass
class ForwardShare:
    """Per-forward CSA2 state, handed down the layers (owned by one forward, never module-level). Pool views see
    every row visible to this forward (cached and new)."""

    pools: dict[int, PoolView] = field(default_factory=dict)  # source -> its view, from its owner's write_pool
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [B, S, k] pool rows, -1 = none
    candidates: torch.Tensor | None = None  # [B, S, N] bool, published by the candidate source
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # filled only when recording
    record_selection: bool = False  # keep scores and candidates of every index source (tests, inspection)
    candidate_history: dict[int, torch.Tensor] = field(default_factory=dict)
    store: ForwardStore | None = None  # where the layers read and write KV: the cache's or the cache-less store
    pool_ready: set[int] = field(default_factory=set)  # pool owners whose rows this forward already wrote
    window_floor: torch.Tensor | None = None  # [B] lowest position a window may list (bounded replay)
    visible: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # ratio -> (positions, rows)

    def visible_rows(self, positions: torch.Tensor, ratio: int) -> torch.Tensor:
        """[B,S] pool rows each query may see in a ratio's pool: computed once per forward and ratio."""
        held = self.visible.get(ratio)
        if held is None or held[0] is not positions:
            rows = torch.div(positions + 1, ratio, rounding_mode="floor").clamp_min(0)
            held = self.visible[ratio] = (positions, rows)
        return held[1]


class DeepseekV41Attention(nn.Module):
    """One attention layer: a sliding window, and on a compressed layer the top-k rows of a pool. Its CSA2 role
    comes from its `LayerSpec` (`config/layer_plan.py`'s `CSA2Role`):

    - Full (the pool owner): compresses each chunk into its pool (`compress`), scores the pool, publishes a top-k;
    - Reindex: scores the Full layer's pool with its own indexer, inside the candidate blocks, publishes a top-k;
    - Reuse: attends over the rows the latest Full or Reindex layer selected, scoring nothing.

    Shared pools, keys and selections travel through the per-forward `ForwardShare`."""

    def __init__(self, config, spec: LayerSpec, quantized: bool) -> None:
        super().__init__()
        self.spec = spec
        self.head_dim = config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.o_lora_rank = config.o_lora_rank
        self.window = config.sliding_window
        self.softmax_scale = self.head_dim**-0.5
        fp8 = "fp8" if quantized else "dense"
        heads, groups = config.num_attention_heads, config.o_groups
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=weight_dtype(torch.float32)))
        self.wq_a = DeepseekV41Linear(config.hidden_size, config.q_lora_rank, storage=fp8)
        self.q_norm = DeepseekV41RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = DeepseekV41Linear(config.q_lora_rank, heads * self.head_dim, storage=fp8)
        self.wkv = DeepseekV41Linear(config.hidden_size, self.head_dim, storage=fp8)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)
        # block-diagonal over groups: applied as a grouped einsum, in bf16 (exact dequantization of the FP8 bytes)
        self.wo_a = DeepseekV41Weight(heads * self.head_dim // groups, groups * self.o_lora_rank, storage=fp8)
        self.wo_b = DeepseekV41Linear(groups * self.o_lora_rank, config.hidden_size, storage=fp8)
        if spec.is_full:  # only the pool owner compresses
            self.compressor = DeepseekV41Compressor(config, spec.ratio)
        if spec.is_full or spec.is_reindex:  # the two roles that score a pool
            self.indexer = DeepseekV41Indexer(config, spec, quantized)

    @property
    def n_heads(self) -> int:
        """The query heads this layer runs, read from the sinks it holds (one per head): a tensor-parallel rank
        holds its heads' sinks and wq_b rows, so sharding rewrites no attribute."""
        return self.attn_sink.shape[0]

    @property
    def n_groups(self) -> int:
        """The output groups this layer runs, read from the rows of wo_a it holds (o_lora_rank per group)."""
        return self.wo_a.weight.shape[0] // self.o_lora_rank

    def compress(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, share) -> None:
        """The Full role's compress step: compress this chunk into new pool rows (RoPE'd at each group's first
        token, FP4-QDQ'd) and their index keys through the store, and publish the pool's view for the layers that
        read it. CED's bounded replay calls it ahead of the layer's forward and marks the pool written
        (`share.pool_ready`)."""
        source = self.spec.layer_id
        if source in share.pool_ready:
            return
        share.pools[source] = share.store.write_pool(source, positions, partial(self._pool_chunk, x, inv_freq),
                                                     x.dtype)

    def _pool_chunk(self, x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor, carry: Carry | None,
                    fixed_shapes: bool) -> PoolChunk:
        """The new pool rows of the chunk x at `positions` (those the store still needs), continuing `carry`."""
        out = self.compressor(x, positions, carry, fixed_shapes=fixed_shapes)
        rotation = rope_angles(out.rows.clamp_min(0) * self.spec.ratio, inv_freq)
        keys, key_codes = self.indexer.keys(out.latents, rotation)
        rotated, codes = rotated_fp4_rows(out.latents, rotation, self.rope_dim, POOL_KV_BLOCK, "e4m3")
        return PoolChunk(out, rotated, codes, keys, key_codes)

    def _output(self, o: torch.Tensor) -> torch.Tensor:
        batch, seq = o.shape[:2]
        o = self.wo_a.grouped(o.reshape(batch, seq, self.n_groups, -1))
        return self.wo_b(o.flatten(2))

    def query_heads(self, x: torch.Tensor, latent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed low-rank query qr, the queries [B,S,H,hd] before RoPE) of x [B,S,D]; latent: wq_a(x) when
        already computed."""
        qr = self.q_norm(self.wq_a(x) if latent is None else latent)
        return qr, self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))

    def queries(self, x: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed low-rank query qr, the RoPE'd queries [B,S,H,hd]) of x [B,S,D]."""
        qr, q = self.query_heads(x)
        return qr, apply_rope_tail(q, rotation, self.rope_dim)

    def window_kv(self, x: torch.Tensor, rotation: torch.Tensor, latent: torch.Tensor | None = None) -> torch.Tensor:
        """The single K=V latent [B,S,hd] of x, RoPE'd and FP8-QDQ'd as every window entry is; latent: wkv(x) when
        already computed."""
        return window_kv(self.wkv(x) if latent is None else latent, self.kv_norm, rotation, self.rope_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotation: torch.Tensor, inv_freq: torch.Tensor,
                share) -> torch.Tensor:
        """x [B,S,D] normed; positions [B,S] (-1: padding); rotation [B,S,rope/2] at the query positions."""
        q_latent, kv_latent = linear_pair(x, self.wq_a, self.wkv)  # both read x: one launch on the kernels
        qr, q = self.query_heads(x, q_latent)
        kv = self.window_kv(x, rotation, kv_latent)
        spec = self.spec
        pool = selected = None
        if spec.reads_pool:
            if spec.is_full:
                self.compress(x, positions, inv_freq, share)
            pool = share.pools[spec.pool_source]
            if spec.is_full or spec.is_reindex:
                visible = share.visible_rows(positions, spec.ratio)
                share.topk[spec.layer_id] = self.indexer(x, qr, rotation, pool, visible, share)
            selected = share.topk[spec.topk_source]  # its own top-k (Full, Reindex), the latest one's (Reuse)
        window = share.store.window(spec.layer_id, kv, positions, self.window, share.window_floor)
        if window.stored is not None:  # decode-sized chunk on a cache: the ring holds every window entry
            o = attend_stored(q, rotation, self.rope_dim, positions, self.window, share.window_floor, window.stored,
                              pool.stored if selected is not None else None, selected, self.attn_sink,
                              self.softmax_scale)
            return self._output(o)
        q = apply_rope_tail(q, rotation, self.rope_dim)
        # queries in chunks, so that long prefills gather a bounded number of entries at a time
        outputs = []
        for start in range(0, q.shape[1], QUERY_CHUNK):
            queries = slice(start, start + QUERY_CHUNK)
            entries, valid = window.entries(queries)
            if selected is not None:
                rows = selected[:, queries]
                entries = torch.cat([entries, pool.gather(rows.clamp_min(0), kv.dtype)], dim=2)
                valid = torch.cat([valid, rows >= 0], dim=2)
            outputs.append(sparse_attention(q[:, queries], entries, valid, self.attn_sink, self.softmax_scale))
        o = torch.cat(outputs, dim=1)
        o = apply_rope_tail(o, rotation, self.rope_dim, inverse=True)
        return self._output(o)
