"""One transformer block of the backbone: mHC read -> attention -> mHC write -> mHC read -> MoE -> mHC write."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..config.layer_plan import LayerSpec
from ..kernels.mhc import MixWeights, hc_read, hc_write, hc_write_read
from ..kernels.numerics import weight_dtype
from .attention import DeepseekV41Attention
from .engram import DeepseekV41Engram
from .linear import DeepseekV41RMSNorm
from .moe import DeepseekV41MoE


class DeepseekV41Block(GradientCheckpointingLayer):
    """A block over `hc_mult` residual streams. Single-pass mHC: the attention's mixes, computed from the block
    input, give the FFN's read weights; the FFN's mixes give the next block's attention read weights."""

    def __init__(self, config, spec: LayerSpec, quantized: bool, has_vision_bias: bool,
                 n_experts: int | None = None, top_k: int | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.hc_mult = config.hc_mult
        self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.attn = self._make_attention(config, spec, quantized)
        self.ffn = DeepseekV41MoE(config, n_experts or config.n_routed_experts, top_k or config.num_experts_per_tok,
                                  quantized, has_vision_bias)
        self.attn_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        mix, width = (2 + config.hc_mult) * config.hc_mult, config.hc_mult * config.hidden_size
        for sublayer in ("attn", "ffn"):
            setattr(self, f"hc_{sublayer}_fn", nn.Parameter(torch.empty(mix, width, dtype=weight_dtype(torch.float32))))
            setattr(self, f"hc_{sublayer}_base", nn.Parameter(torch.empty(mix, dtype=weight_dtype(torch.float32))))
            setattr(self, f"hc_{sublayer}_scale", nn.Parameter(torch.empty(3, dtype=weight_dtype(torch.float32))))

    def _make_attention(self, config, spec: LayerSpec, quantized: bool) -> nn.Module:
        return DeepseekV41Attention(config, spec, quantized)

    def mix_weights(self, sublayer: str) -> MixWeights:
        return MixWeights(getattr(self, f"hc_{sublayer}_fn"), getattr(self, f"hc_{sublayer}_scale"),
                          getattr(self, f"hc_{sublayer}_base"), self.hc_sinkhorn_iters, self.hc_eps, self.norm_eps)

    def forward(self, streams: torch.Tensor, pre_mix: torch.Tensor, image_mask: torch.Tensor | None,
                *attention_args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B,S,hc,D], pre_mix [B,S,hc] from the previous sublayer. Returns (streams, the next block's
        pre_mix, router logits, chosen experts)."""
        attn_mix, x = hc_read(streams, pre_mix, self.mix_weights("attn"), self.attn_norm)
        attn_out = self.attn(x, *attention_args)
        streams, ffn_mix, x = hc_write_read(attn_out, streams, attn_mix, self.mix_weights("ffn"), self.ffn_norm)
        ffn_out, router_logits, experts = self.ffn(x, image_mask)
        return hc_write(ffn_out, streams, ffn_mix), ffn_mix.pre, router_logits, experts

    def compress_only(self, streams: torch.Tensor, pre_mix: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, share) -> None:
        """Only what the pool needs from this block (a Full layer): its attention input, compressed into pool rows
        and keys (CED's bounded replay runs this over every prompt token, the block itself over the last ones)."""
        _, x = hc_read(streams, pre_mix, self.mix_weights("attn"), self.attn_norm)  # the forward's own x, bit for bit
        self.attn.compress(x, positions, inv_freq, share)


class DeepseekV41BackboneBlock(DeepseekV41Block):
    """A backbone block, optionally preceded by Engram (applied to the streams before the block reads them)."""

    def __init__(self, config, spec: LayerSpec, quantized: bool, has_vision_bias: bool) -> None:
        super().__init__(config, spec, quantized, has_vision_bias)
        if spec.engram_slot is not None:
            self.engram = DeepseekV41Engram(config, config.engram_num_embeddings[spec.engram_slot], quantized)
