"""The mHC ops: the exact math of single-pass manifold-constrained hyper-connections (the reference's) and the
device choice for each step. A block reads a sublayer's input from the `hc_mult` residual streams (`hc_read`),
writes the sublayer's output back (`hc_write`), or both at once (`hc_write_read`, between its two sublayers).

Each sublayer's mix coefficients come from the streams *before* it; its read weights (pre) are used one sublayer
later. On CUDA inference each step is one or two Triton launches (`triton/mhc.py`); elsewhere the exact functions
below.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dispatch import kernel_path
from .linear import row_invariant_linear
from .numerics import compute_dtype


class HyperMix(NamedTuple):
    pre: torch.Tensor  # [B, S, hc] read weights of the *next* sublayer
    post: torch.Tensor  # [B, S, hc] write weights of this sublayer's output
    comb: torch.Tensor  # [B, S, hc, hc] doubly-stochastic residual mixing, comb[i][j]: stream i -> stream j


class MixWeights(NamedTuple):
    """A sublayer's mix parameters and the constants of the mixing."""

    fn: torch.Tensor  # [(2 + hc) * hc, hc * D] fp32 projection
    scale: torch.Tensor  # [3]
    base: torch.Tensor  # [(2 + hc) * hc]
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float  # the RMS statistic's epsilon


def hc_mixes(streams: torch.Tensor, mix: MixWeights) -> HyperMix:
    """One sublayer's (pre, post, comb) from the streams [B,S,hc,D]: an fp32 projection and Sinkhorn."""
    x = streams.flatten(2).to(compute_dtype(streams))
    # one RMS statistic per token over all streams, applied after the projection
    mixes = row_invariant_linear(x, mix.fn.to(x.dtype)) * torch.rsqrt(x.square().mean(-1, keepdim=True) + mix.norm_eps)
    hc = streams.shape[-2]
    return HyperMix(*split_sinkhorn(mixes, mix.scale.to(x.dtype), mix.base.to(x.dtype), hc, mix.sinkhorn_iters,
                                    mix.hc_eps))


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


FUSED_HC = 4  # the launch's layout of the mixes is made for 4 streams (the released model's hc_mult)


def _fused(streams: torch.Tensor) -> bool:
    return kernel_path(streams) and streams.shape[-2] == FUSED_HC


def hc_read(streams: torch.Tensor, read_weights: torch.Tensor, mix: MixWeights, norm: torch.nn.Module
            ) -> tuple[HyperMix, torch.Tensor]:
    """(this sublayer's mixes, its input: `norm` (an RMSNorm) of the streams collapsed with the read weights the
    previous sublayer's mixes gave it)."""
    if _fused(streams):
        from .triton import hc_step
        _, pre, post, comb, x = hc_step(streams, read_weights, mix.fn, mix.scale, mix.base, norm.weight,
                                        mix.sinkhorn_iters, mix.hc_eps, mix.norm_eps, norm.eps)
        return HyperMix(pre, post, comb), x
    return hc_mixes(streams, mix), norm(hc_collapse(streams, read_weights))


def hc_write(output: torch.Tensor, streams: torch.Tensor, written: HyperMix) -> torch.Tensor:
    """The streams after a sublayer's output [B,S,D] is written into them with that sublayer's mixes."""
    if _fused(streams):
        from .triton import hc_expand as expand_kernel
        return expand_kernel(output, streams, written.post, written.comb)
    return hc_expand(output, streams, written.post, written.comb)


def hc_write_read(output: torch.Tensor, streams: torch.Tensor, written: HyperMix, mix: MixWeights,
                  norm: torch.nn.Module) -> tuple[torch.Tensor, HyperMix, torch.Tensor]:
    """hc_write then hc_read of the next sublayer (whose read weights are `written.pre`), two launches on CUDA:
    (the new streams, the next sublayer's mixes, its normed input)."""
    if _fused(streams):
        from .triton import hc_step
        new, pre, post, comb, x = hc_step(streams, written.pre, mix.fn, mix.scale, mix.base, norm.weight,
                                          mix.sinkhorn_iters, mix.hc_eps, mix.norm_eps, norm.eps, output,
                                          written.post, written.comb)
        return new, HyperMix(pre, post, comb), x
    streams = hc_expand(output, streams, written.post, written.comb)
    return (streams,) + hc_read(streams, written.pre, mix, norm)


def initial_streams(hidden: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The embeddings copied into the hc streams, and the one-hot collapse weights of the first block."""
    streams = hidden.unsqueeze(2).repeat(1, 1, hc_mult, 1)
    pre_mix = torch.zeros(*streams.shape[:3], dtype=compute_dtype(streams), device=streams.device)
    pre_mix[..., 0] = 1.0
    return streams, pre_mix


__all__ = ["HyperMix", "MixWeights", "hc_collapse", "hc_expand", "hc_mixes", "hc_read", "hc_write",
           "hc_write_read", "initial_streams", "split_sinkhorn"]
