"""Single-pass manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Each sublayer's mix coefficients are computed from the stream *before* it and used one sublayer later: the
attention mixes give the FFN's read weights, the FFN mixes give the next block's attention read weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from ..kernels.dispatch import compiled, fast_path
from ..kernels.numerics import compute_dtype
from ..kernels.linear import row_invariant_linear


class HyperMix(NamedTuple):
    pre: torch.Tensor  # [B, S, hc] read weights of the *next* sublayer
    post: torch.Tensor  # [B, S, hc] write weights of this sublayer's output
    comb: torch.Tensor  # [B, S, hc, hc] doubly-stochastic residual mixing, comb[i][j]: stream i -> stream j


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
             sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> HyperMix:
    """One sublayer's (pre, post, comb) from the streams [B,S,hc,D]: an fp32 projection and Sinkhorn."""
    x = streams.flatten(2).to(compute_dtype(streams))
    # one RMS statistic per token over all streams, applied after the projection
    mixes = row_invariant_linear(x, fn.to(x.dtype)) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    # on an accelerator the 40 small Sinkhorn steps run fused (decode is launch-bound there)
    split = compiled(split_sinkhorn) if fast_path(mixes) else split_sinkhorn
    return HyperMix(*split(mixes, scale.to(x.dtype), base.to(x.dtype), hc_mult, sinkhorn_iters, hc_eps))


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, sinkhorn_iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre and post gates, and the Sinkhorn-normalised residual mixing (ending on a column normalisation)."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb



def hc_collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_c weights[c] * streams[c] in the compute dtype, cast back: [B,S,hc,D] x [B,S,hc] -> [B,S,D]."""
    y = torch.sum(weights.unsqueeze(-1) * streams.to(weights.dtype), dim=2)
    return y.to(streams.dtype)


def hc_expand(output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """stream_j = post[j] * output + sum_i comb[i][j] * residual_i, cast back to the output dtype."""
    y = post.unsqueeze(-1) * output.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return y.to(output.dtype)


def initial_streams(hidden: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings copied into the hc streams, and the one-hot collapse weights of the first block."""
    streams = hidden.unsqueeze(2).repeat(1, 1, hc_mult, 1)
    pre_mix = torch.zeros(*streams.shape[:3], dtype=compute_dtype(streams), device=streams.device)
    pre_mix[..., 0] = 1.0
    return streams, pre_mix
