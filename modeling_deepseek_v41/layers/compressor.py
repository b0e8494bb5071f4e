"""The KV compressor of a pool-owning layer: ratio-r groups of tokens pooled into one latent row."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..kernels.compress import pool_groups
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
        if self.ratio == 1:
            return self._per_token(x, positions, fixed_shapes)
        h = x.to(compute_dtype(x))
        kv, score = self.wkv(h), self.wgate(h)
        latents, pool_rows, carry = pool_groups(kv, score, positions, carry, self.ratio, fixed_shapes, x.dtype)
        return CompressorOutput(self.norm(latents), pool_rows, carry, kv, score)

    def _per_token(self, x, positions, fixed_shapes: bool):
        """Ratio 1: every token is a pool row; rows are laid out by position from each row's first position."""
        live = positions >= 0
        first = torch.where(live, positions, torch.iinfo(positions.dtype).max).amin(dim=1)
        last = torch.where(live, positions, -1).amax(dim=1)
        latents = self.norm(self.wkv(x))
        n_done = x.shape[1] if fixed_shapes else int((last + 1 - first).amax().clamp_min(0))
        local = torch.where(live, positions - first.unsqueeze(1), n_done)  # dead tokens land in a dropped slot
        out = latents.new_zeros(x.shape[0], n_done + 1, latents.shape[-1])
        out.scatter_(1, local.unsqueeze(-1).expand_as(latents), latents)
        rows = torch.full((x.shape[0], n_done + 1), -1, dtype=positions.dtype, device=x.device)
        rows.scatter_(1, local, torch.where(live, positions, -1))
        return CompressorOutput(out[:, :n_done], rows[:, :n_done], None, None, None)
