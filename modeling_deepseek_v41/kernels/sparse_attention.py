"""Sparse single-KV-head attention over listed entries, with an attention sink, and the selection helpers."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from .dispatch import fast_path, kernel_path
from .gpu_linear import triton_kernels
from .numerics import compute_dtype, fp4_dequantize_rows, fp8_act_qdq, fp8_dequantize_rows
from .rope import apply_rope_tail

SOFTMAX_BLOCK = 64  # the reference kernel walks each query's list in blocks of 64 entries


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; exact ties go to the earlier index.

    Deterministic whatever the row width or device, so chunked and one-shot prefill select alike.
    """
    if k == 0:
        return scores.new_empty(*scores.shape[:-1], 0, dtype=torch.long)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_ascending(scores: torch.Tensor, k: int, drop_unreachable: bool = False) -> torch.Tensor:
    """The positions stable_topk_indices chooses, in ascending order; drop_unreachable: those whose score is -inf
    (or NaN) become -1, after the others. On CUDA inference a radix select per row instead of sorts."""
    if kernel_path(scores) and k > 0:
        return triton_kernels().topk_ascending(scores, k, drop_unreachable)
    chosen = stable_topk_indices(scores, k)
    if not drop_unreachable:
        return chosen.sort(dim=-1).values
    width = scores.shape[-1]
    chosen = torch.where(scores.gather(-1, chosen) > -torch.inf, chosen, width).sort(dim=-1).values
    return torch.where(chosen == width, -1, chosen)


def _fused_sparse_attention(q: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                            softmax_scale: float) -> torch.Tensor:
    """sparse_attention's blocked online softmax in closed form: a few large ops instead of a loop (the accelerator
    path; run eagerly: Inductor's CUDA code for it moved the fixtures' logits by 0.10 rel. L2, eager by 0.008).

    The running max after each block of 64 entries is the cumulative max of the block maxima, so every block's
    probabilities (rounded to bf16 against it, as the reference does for bf16) and its rescale to the final max
    are known at once: the same math as the sequential loop, summed in another order."""
    acc = compute_dtype(q)
    logits = torch.einsum("bshd,bskd->bshk", q.to(acc), entries.to(acc)) * softmax_scale
    logits = torch.where(valid.unsqueeze(2), logits, -torch.inf)
    width = logits.shape[-1]
    block = SOFTMAX_BLOCK if q.dtype == torch.bfloat16 else max(width, 1)
    blocks = F.pad(logits, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block))
    running = torch.cummax(blocks.amax(dim=-1).clamp_min(-1e30), dim=-1).values  # the running max starts at -1e30
    probs = torch.exp(blocks - running.unsqueeze(-1))
    final = running[..., -1]
    to_final = torch.exp(running - final.unsqueeze(-1))
    # a query with nothing to attend to outputs zeros; keep its sink term finite
    sink_term = torch.exp(torch.where(final <= -1e30, torch.zeros_like(final), sink.to(acc) - final))
    denominator = (probs.sum(dim=-1) * to_final).sum(dim=-1) + sink_term
    if q.dtype == torch.bfloat16:
        probs = probs.to(torch.bfloat16).float()
    numerator_probs = (probs * to_final.unsqueeze(-1)).flatten(-2)[..., :width]
    numerator = torch.einsum("bshk,bskd->bshd", numerator_probs, entries.to(acc))
    return (numerator / denominator.unsqueeze(-1)).to(q.dtype)


def sparse_attention(q: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Attend each query to its own listed entries (K = V).

    q [B,S,H,d]; entries [B,S,K,d] gathered per query; valid [B,S,K]; sink [H] fp32, added to the denominator
    unscaled. A query with no valid entry outputs zeros. In bf16 the reference kernel's online softmax is
    reproduced: blocks of 64 entries, probabilities rounded to bf16 against the running max in the numerator,
    fp32 in the denominator. Other dtypes take one exact softmax. On an accelerator (inference) a fused single
    softmax runs instead.
    """
    if fast_path(q):
        return _fused_sparse_attention(q, entries, valid, sink, softmax_scale)
    acc_dtype = compute_dtype(q)
    qf, kvf = q.to(acc_dtype), entries.to(acc_dtype) * valid.unsqueeze(-1)
    scale = torch.tensor(softmax_scale, dtype=acc_dtype)
    running_max = torch.full(q.shape[:3], -1e30, dtype=acc_dtype, device=q.device)
    denominator = torch.zeros(q.shape[:3], dtype=acc_dtype, device=q.device)
    out = torch.zeros(qf.shape, dtype=acc_dtype, device=q.device)
    block = SOFTMAX_BLOCK if q.dtype == torch.bfloat16 else max(entries.shape[2], 1)
    for start in range(0, entries.shape[2], block):
        kv_block = kvf[:, :, start:start + block]
        logits = torch.einsum("bshd,bskd->bshk", qf, kv_block)
        logits = torch.where(valid[:, :, None, start:start + block], logits, -torch.inf) * scale
        previous_max = running_max
        running_max = torch.maximum(previous_max, logits.amax(dim=-1))
        rescale = torch.exp(previous_max - running_max)
        probs = torch.exp(logits - running_max.unsqueeze(-1))
        denominator = denominator * rescale + probs.sum(dim=-1)
        if q.dtype == torch.bfloat16:
            probs = probs.to(torch.bfloat16).to(acc_dtype)
        out = out * rescale.unsqueeze(-1) + torch.einsum("bshk,bskd->bshd", probs, kv_block)
    # a query with nothing to attend to (padding) outputs zeros; keep its sink term finite so gradients stay finite
    empty = running_max <= -1e30
    sink_term = torch.exp(torch.where(empty, torch.zeros_like(running_max), sink.to(acc_dtype) - running_max))
    denominator = denominator + sink_term
    return (out / denominator.unsqueeze(-1)).to(q.dtype)


def list_window(positions: torch.Tensor, window: int, width: int, floor: torch.Tensor | None = None,
                offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's window, oldest first: the positions listed [B,S,width], their validity, and the chunk index
    each position has if it is in the chunk. positions [B,S] are contiguous within a row (-1 marks padding);
    query i at position p lists max(0, p-W+1) .. p, and position q sits at chunk index offset + i - (p - q).
    Positions below `floor` [B] are hidden (a window restricted to a replayed segment)."""
    p = positions.unsqueeze(-1)
    listed = (p - window + 1).clamp_min(0) + torch.arange(max(width, 0), device=positions.device)
    valid = (listed <= p) & (p >= 0)
    if floor is not None:
        valid = valid & (listed >= floor.view(-1, 1, 1))
    chunk_index = offset + torch.arange(positions.shape[1], device=positions.device).view(1, -1, 1) - (p - listed)
    return listed, valid, chunk_index


def window_kv(kv: torch.Tensor, norm: torch.nn.Module, rotation: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """A window entry from its projection kv [B,S,hd]: `norm` (an RMSNorm), RoPE at `rotation`, FP8 QDQ; one
    launch on CUDA inference."""
    dim = kv.shape[-1]
    if kernel_path(kv) and dim % 64 == 0 and dim & (dim - 1) == 0:
        from .triton import window_kv as fused
        return fused(kv, norm.weight, norm.eps, rotation, rope_dim)
    return fp8_act_qdq(apply_rope_tail(norm(kv), rotation, rope_dim))


class StoredWindow(NamedTuple):
    """A layer's window ring as a cache stores it, and how many entries each query lists from it."""

    codes: torch.Tensor  # [B, slots, D] uint8: e4m3 bits
    scales: torch.Tensor  # [B, slots, D/32] uint8: E8M0 bits
    positions: torch.Tensor  # [B, slots] the position each slot holds (-1: empty)
    width: int  # entries listed per query, oldest first (the window, or fewer while the cache is shorter)


class StoredPool(NamedTuple):
    """A compressed pool's rows as a cache stores them."""

    codes: torch.Tensor  # [B, rows, D/2] uint8: e2m1 pairs, the even element in the low nibble
    scales: torch.Tensor  # [B, rows, D/16] uint8: e4m3 bits


def attend_stored(q: torch.Tensor, rotation: torch.Tensor, rope_dim: int, positions: torch.Tensor, window: int,
                  floor: torch.Tensor | None, ring: StoredWindow, pool: StoredPool | None,
                  selected: torch.Tensor | None, sink: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """CSA2 attention of queries whose whole window is in the ring (the chunk's own entries already written).

    q [B,S,H,D] before RoPE, rotated here at `rotation`; each query attends to its window (positions
    max(0, p-window+1) onward, `ring.width` of them, those the ring holds at or below p and at or above `floor`),
    then to the pool rows `selected` [B,S,k] (-1: none), with `sparse_attention`'s numerics; the output gets the
    inverse RoPE. On CUDA inference one fused launch; otherwise the entries are unpacked and listed here."""
    dim = q.shape[-1]
    if kernel_path(q) and dim >= 64 and dim & (dim - 1) == 0 and rope_dim % 2 == 0:  # the launch's dim chunks
        from .triton import stored_attention
        return stored_attention(q, rotation, rope_dim, positions, floor, window, ring, pool, selected, sink,
                                softmax_scale)
    listed, valid, _ = list_window(positions, window, ring.width, floor)
    slots = listed % ring.codes.shape[1]
    flat = slots.flatten(1)
    held = ring.positions.gather(1, flat).view_as(slots)
    valid = valid & (held == listed)
    rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1)
    entries = fp8_dequantize_rows(ring.codes[rows, flat].view(torch.float8_e4m3fn),
                                  ring.scales[rows, flat], q.dtype)  # E8M0 bytes: decoded by integer shifts
    entries = entries.view(*slots.shape, q.shape[-1])
    if selected is not None:
        picks = selected.clamp_min(0).flatten(1)
        pooled = fp4_dequantize_rows(pool.codes[rows, picks], pool.scales[rows, picks].view(torch.float8_e4m3fn),
                                     q.dtype).view(*selected.shape, q.shape[-1])
        entries = torch.cat([entries, pooled], dim=2)
        valid = torch.cat([valid, selected >= 0], dim=2)
    o = sparse_attention(apply_rope_tail(q, rotation, rope_dim), entries, valid, sink, softmax_scale)
    return apply_rope_tail(o, rotation, rope_dim, inverse=True)


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """Level one of the two-level selection: per query, the `topk_blocks` blocks of `block_size` compressed
    positions with the best maximum score. The block holding the newest visible position is always kept (it is
    only partly filled); unreachable blocks are dropped. scores [B,S,N] (-inf where invisible), visible [B,S]
    counts. Returns the chosen block ids [B,S,min(topk_blocks, n_blocks)], ascending, -1 for dropped picks."""
    width = scores.shape[-1]
    block_scores = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    block_scores = block_scores.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = block_scores.shape[-1]
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")
    block_ids = torch.arange(n_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(block_ids == newest.unsqueeze(-1), torch.inf)
    return topk_ascending(block_scores, min(topk_blocks, n_blocks), drop_unreachable=True)


def candidate_mask(blocks: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Chosen block ids [B,S,nb] (-1 unused) -> bool mask [B,S,width] over compressed positions."""
    n_blocks = -(-width // block_size)
    keep = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, torch.where(blocks >= 0, blocks, n_blocks), True)
    return keep[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :width]
