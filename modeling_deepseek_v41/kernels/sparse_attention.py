"""Sparse single-KV-head attention over listed entries, with an attention sink, and the selection helpers."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .dispatch import compiled, fast_path
from .numerics import compute_dtype

SOFTMAX_BLOCK = 64  # the reference kernel walks each query's list in blocks of 64 entries


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; exact ties go to the earlier index.

    Deterministic whatever the row width or device, so chunked and one-shot prefill select alike.
    """
    if k == 0:
        return scores.new_empty(*scores.shape[:-1], 0, dtype=torch.long)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _fused_sparse_attention(q: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                            softmax_scale: float) -> torch.Tensor:
    """One softmax over all listed entries (sink in the denominator, bf16-rounded probabilities in the numerator):
    the accelerator path, compiled into a few kernels. It differs from the CPU reference path only in the last
    bits when a query lists more than 64 entries."""
    logits = torch.einsum("bshd,bskd->bshk", q.float(), entries.float()) * softmax_scale
    logits = torch.where(valid.unsqueeze(2), logits, -torch.inf)
    running_max = torch.maximum(logits.amax(dim=-1), torch.full_like(logits[..., 0], -1e30))
    probs = torch.exp(logits - running_max.unsqueeze(-1))
    denominator = probs.sum(dim=-1) + torch.exp(sink.float() - running_max)
    numerator = torch.einsum("bshk,bskd->bshd", probs.to(q.dtype).float(), entries.float())
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
        return compiled(_fused_sparse_attention)(q, entries, valid, sink, softmax_scale)
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
    chosen = stable_topk_indices(block_scores, min(topk_blocks, n_blocks))
    reachable = block_scores.gather(-1, chosen) > -torch.inf
    ids = torch.where(reachable, chosen, n_blocks).sort(dim=-1).values
    return torch.where(ids == n_blocks, -1, ids)


def candidate_mask(blocks: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Chosen block ids [B,S,nb] (-1 unused) -> bool mask [B,S,width] over compressed positions."""
    n_blocks = -(-width // block_size)
    keep = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, torch.where(blocks >= 0, blocks, n_blocks), True)
    return keep[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :width]


def candidate_positions(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Chosen block ids [B,S,nb] -> the compressed positions they hold [B,S,nb*block_size], ascending (-1 unused)."""
    offsets = torch.arange(block_size, device=blocks.device)
    positions = blocks.unsqueeze(-1) * block_size + offsets
    return torch.where(blocks.unsqueeze(-1) >= 0, positions, -1).flatten(-2)
