"""Engram: hashed n-gram table rows gated into every residual stream before the block."""

from __future__ import annotations

import torch
from torch import nn

from .numerics import WEIGHT_BLOCK, compute_dtype, weight_dtype
from .quantized_linear import DeepseekV41Linear


class DeepseekV41EngramTable(nn.Module):
    """The FP8 n-gram table [rows, head_dim] with E8M0 scales per 32 columns; rows are dequantized on lookup."""

    def __init__(self, rows: int, head_dim: int, quantized: bool) -> None:
        super().__init__()
        self.quantized = quantized
        if quantized:
            self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(rows, head_dim // WEIGHT_BLOCK, dtype=torch.float8_e8m0fnu),
                                      requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=weight_dtype(torch.bfloat16)))
            self.register_parameter("scale", None)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[row_ids]
        if not self.quantized:
            return rows
        scales = self.scale[row_ids].float().unsqueeze(-1)
        return (rows.float().unflatten(-1, (-1, WEIGHT_BLOCK)) * scales).flatten(-2).to(torch.bfloat16)

    @torch.no_grad()
    def dequantize_(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if not self.quantized:
            return
        dense = (self.weight.float().unflatten(-1, (-1, WEIGHT_BLOCK)) * self.scale.float().unsqueeze(-1)).flatten(-2)
        del self.weight, self.scale
        self.weight = nn.Parameter(dense.to(dtype))
        self.register_parameter("scale", None)
        self.quantized = False


class DeepseekV41Engram(nn.Module):
    """out_c = h_c + gate_c * value, with one key per stream and a shared value projected from the looked-up rows.

    gate_c = sigmoid(signed_sqrt(<h_c, q_w k_w key_c> / (rms(h_c) rms(key_c) sqrt(D)))); dead positions get 0.
    """

    def __init__(self, config, rows: int, quantized: bool) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.eps = config.rms_norm_eps
        n_columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.embed = DeepseekV41EngramTable(rows, config.engram_head_dim, quantized)
        self.wkv = DeepseekV41Linear(n_columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1),
                                     storage="fp8" if quantized else "dense")
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=weight_dtype(torch.bfloat16)))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=weight_dtype(torch.bfloat16)))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """streams [B,S,hc,D]; row_ids [B,S,columns]; live [B,S] bool (False: image span or padding)."""
        rows = self.embed(row_ids).to(streams.dtype).flatten(-2)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        acc = compute_dtype(streams)
        key = key.to(acc).unflatten(-1, (self.hc_mult, self.hidden_size))
        weight = self.q_weight.to(acc) * self.k_weight.to(acc)
        h = streams.to(acc)
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.hidden_size**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if live is not None:
            gate = gate.masked_fill(~live.unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.to(acc).unsqueeze(-2)).to(streams.dtype)
