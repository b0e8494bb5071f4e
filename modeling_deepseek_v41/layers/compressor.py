"""The KV compressor of a pool-owning layer: ratio-r groups of tokens pooled into one latent row."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..kernels.numerics import compute_dtype
from .linear import DeepseekV41Linear, DeepseekV41RMSNorm


class CompressorOutput(NamedTuple):
    latents: torch.Tensor  # [B, G, hd] pre-RoPE latents of the groups this chunk completed (zeros elsewhere)
    rows: torch.Tensor  # [B, G] pool row of each latent, -1 where none
    carry: tuple[torch.Tensor, torch.Tensor] | None  # (kv, score) [B, r, hd] of each row's open group
    token_kv: torch.Tensor | None  # [B, S, hd] the chunk's per-token projections (ratio > 1)
    token_score: torch.Tensor | None


class DeepseekV41Compressor(nn.Module):
    """Ratio 1: latent = norm(wkv(x)). Ratio r > 1: per channel, a softmax over each group's r tokens of the
    fp32 gate scores weights their fp32 kv projections. Returns latents before RoPE: the indexer needs them so."""

    def __init__(self, config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.norm = DeepseekV41RMSNorm(config.head_dim, config.rms_norm_eps)
        weight_dtype = torch.float32 if ratio > 1 else torch.bfloat16
        self.wkv = DeepseekV41Linear(config.hidden_size, config.head_dim, dtype=weight_dtype)
        if ratio > 1:
            self.wgate = DeepseekV41Linear(config.hidden_size, config.head_dim, dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                carry: tuple[torch.Tensor, torch.Tensor] | None = None, fixed_shapes: bool = False
                ) -> CompressorOutput:
        """x [B,S,D], positions [B,S] (-1: padding); `carry` continues each row's open group from earlier calls.

        With `fixed_shapes` (the store's choice: a cache drops the unused rows, a traced graph cannot read the count
        back) the outputs have as many groups as the chunk could span, decided from its width alone, so nothing is
        read back from the device; unused rows are -1."""
        live = positions >= 0
        big = torch.iinfo(positions.dtype).max
        first = torch.where(live, positions, big).amin(dim=1).clamp_max(big - 1)
        last = torch.where(live, positions, -1).amax(dim=1)
        if self.ratio == 1:
            return self._per_token(x, positions, live, first, last, fixed_shapes)
        r = self.ratio
        acc = compute_dtype(x)
        h = x.to(acc)
        kv, score = self.wkv(h), self.wgate(h)
        base_group = torch.div(first, r, rounding_mode="floor")
        open_group = torch.div(last + 1, r, rounding_mode="floor") - base_group
        if fixed_shapes:  # a row's tokens span at most this many groups
            n_groups = (x.shape[1] + r - 2) // r + 1
            n_done = n_groups
        else:
            n_groups = int((torch.div(last, r, rounding_mode="floor") - base_group).amax().clamp_min(-1)) + 1
            n_done = int(open_group.amax().clamp_min(0))
        batch, hd = x.shape[0], kv.shape[-1]
        # token slots of groups base_group .. base_group + n_groups, the first one continuing the carry
        slot_index = (torch.div(positions, r, rounding_mode="floor") - base_group.unsqueeze(1)) * r + positions % r
        slot_index = torch.where(live, slot_index, (n_groups + 1) * r)
        group_kv = kv.new_zeros(batch, (n_groups + 1) * r + 1, hd)
        group_score = kv.new_full((batch, (n_groups + 1) * r + 1, hd), -torch.inf)
        filled = torch.zeros(batch, (n_groups + 1) * r + 1, dtype=torch.bool, device=x.device)
        if carry is not None:
            carry_kv, carry_score = carry
            group_kv[:, :r], group_score[:, :r] = carry_kv.to(acc), carry_score.to(acc)
            filled[:, :r] = carry_score[..., 0] > -torch.inf
        per_channel = slot_index.unsqueeze(-1).expand(-1, -1, hd)
        group_kv = group_kv.scatter_(1, per_channel, kv)[:, :-1].unflatten(1, (n_groups + 1, r))
        group_score = group_score.scatter_(1, per_channel, score)[:, :-1].unflatten(1, (n_groups + 1, r))
        filled = filled.scatter_(1, slot_index, live)[:, :-1].unflatten(1, (n_groups + 1, r))
        # the group holding the next position is the one left open; every group before it is complete
        latents = (group_kv[:, :n_done] * group_score[:, :n_done].softmax(dim=2)).sum(dim=2)
        complete = filled[:, :n_done].all(dim=-1)
        latents = torch.where(complete.unsqueeze(-1), latents, torch.zeros_like(latents))
        pool_rows = torch.where(complete, base_group.unsqueeze(1) + torch.arange(n_done, device=x.device), -1)
        gather = open_group.clamp(0, n_groups).view(batch, 1, 1, 1).expand(batch, 1, r, hd)
        new_kv = group_kv.gather(1, gather).squeeze(1)
        new_score = group_score.gather(1, gather).squeeze(1)
        return CompressorOutput(self.norm(latents.to(x.dtype)), pool_rows, (new_kv, new_score), kv, score)

    def _per_token(self, x, positions, live, first, last, fixed_shapes: bool):
        """Ratio 1: every token is a pool row; rows are laid out by position from each row's first position."""
        latents = self.norm(self.wkv(x))
        n_done = x.shape[1] if fixed_shapes else int((last + 1 - first).amax().clamp_min(0))
        local = torch.where(live, positions - first.unsqueeze(1), n_done)  # dead tokens land in a dropped slot
        out = latents.new_zeros(x.shape[0], n_done + 1, latents.shape[-1])
        out.scatter_(1, local.unsqueeze(-1).expand_as(latents), latents)
        rows = torch.full((x.shape[0], n_done + 1), -1, dtype=positions.dtype, device=x.device)
        rows.scatter_(1, local, torch.where(live, positions, -1))
        return CompressorOutput(out[:, :n_done], rows[:, :n_done], None, None, None)
