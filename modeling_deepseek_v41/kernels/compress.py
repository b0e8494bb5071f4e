"""The compressor's pooling (the op; the projections and the norm are layers/compressor.py's): each ratio-r group
of a chunk's tokens becomes one row, per channel the softmax over the group's r gate scores weighting their kv
projections; a row is complete when all r tokens are there, and the open group carries over to the next chunk.
The exact math, and on CUDA inference one launch for a chunk of fixed shapes (a decode step) instead of about
forty small ones."""

from __future__ import annotations

import torch

from .dispatch import kernel_path
from .gpu_linear import triton_kernels

Carry = tuple[torch.Tensor, torch.Tensor]


def fixed_group_count(width: int, ratio: int) -> int:
    """How many groups a chunk of `width` contiguous positions can span (the fixed-shape outputs' count)."""
    return (width + ratio - 2) // ratio + 1


def pool_groups(kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, carry: Carry | None, ratio: int,
                fixed_shapes: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Carry]:
    """(latents [B,G,hd] in `dtype`, zero where incomplete; pool rows [B,G], -1 where none; the new carry (kv,
    score) [B,r,hd]) of the token projections kv, score [B,S,hd] (fp32, or float64) at positions [B,S] (-1:
    padding), continuing `carry`. fixed_shapes: G from the chunk's width alone, nothing read back."""
    if kernel_path(kv) and fixed_shapes and kv.shape[-1] & (kv.shape[-1] - 1) == 0:
        return triton_kernels().pool_groups(kv, score, positions, carry, ratio, dtype)
    r = ratio
    live = positions >= 0
    big = torch.iinfo(positions.dtype).max
    first = torch.where(live, positions, big).amin(dim=1).clamp_max(big - 1)
    last = torch.where(live, positions, -1).amax(dim=1)
    base_group = torch.div(first, r, rounding_mode="floor")
    open_group = torch.div(last + 1, r, rounding_mode="floor") - base_group
    if fixed_shapes:  # a row's tokens span at most this many groups
        n_groups = fixed_group_count(kv.shape[1], r)
        n_done = n_groups
    else:
        n_groups = int((torch.div(last, r, rounding_mode="floor") - base_group).amax().clamp_min(-1)) + 1
        n_done = int(open_group.amax().clamp_min(0))
    batch, hd = kv.shape[0], kv.shape[-1]
    # token slots of groups base_group .. base_group + n_groups, the first one continuing the carry
    slot_index = (torch.div(positions, r, rounding_mode="floor") - base_group.unsqueeze(1)) * r + positions % r
    slot_index = torch.where(live, slot_index, (n_groups + 1) * r)
    group_kv = kv.new_zeros(batch, (n_groups + 1) * r + 1, hd)
    group_score = kv.new_full((batch, (n_groups + 1) * r + 1, hd), -torch.inf)
    filled = torch.zeros(batch, (n_groups + 1) * r + 1, dtype=torch.bool, device=kv.device)
    if carry is not None:
        carry_kv, carry_score = carry
        group_kv[:, :r], group_score[:, :r] = carry_kv.to(kv.dtype), carry_score.to(kv.dtype)
        filled[:, :r] = carry_score[..., 0] > -torch.inf
    per_channel = slot_index.unsqueeze(-1).expand(-1, -1, hd)
    group_kv = group_kv.scatter_(1, per_channel, kv)[:, :-1].unflatten(1, (n_groups + 1, r))
    group_score = group_score.scatter_(1, per_channel, score)[:, :-1].unflatten(1, (n_groups + 1, r))
    filled = filled.scatter_(1, slot_index, live)[:, :-1].unflatten(1, (n_groups + 1, r))
    # the group holding the next position is the one left open; every group before it is complete
    latents = (group_kv[:, :n_done] * group_score[:, :n_done].softmax(dim=2)).sum(dim=2)
    complete = filled[:, :n_done].all(dim=-1)
    latents = torch.where(complete.unsqueeze(-1), latents, torch.zeros_like(latents))
    pool_rows = torch.where(complete, base_group.unsqueeze(1) + torch.arange(n_done, device=kv.device), -1)
    gather = open_group.clamp(0, n_groups).view(batch, 1, 1, 1).expand(batch, 1, r, hd)
    new_kv = group_kv.gather(1, gather).squeeze(1)
    new_score = group_score.gather(1, gather).squeeze(1)
    return latents.to(dtype), pool_rows, (new_kv, new_score)
