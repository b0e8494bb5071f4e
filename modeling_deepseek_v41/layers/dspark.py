"""The DSpark drafter's modules: window-only blocks under the checkpoint's `mtp.{i}` namespace and its heads."""

from __future__ import annotations

import torch
from torch import nn

from ..config.layer_plan import LayerSpec
from ..kernels.numerics import weight_dtype
from ..kernels.sparse_attention import sparse_attention
from .attention import DeepseekV41Attention
from .block import DeepseekV41Block
from .linear import DeepseekV41Linear, DeepseekV41RMSNorm
from .rotary import apply_rope_tail


class DeepseekV41DSparkAttention(DeepseekV41Attention):
    """Drafter attention: the draft block's queries attend to the stage's window of backbone positions (KV
    projected from the backbone taps, kept in the cache's ring for this stage) and to all block positions, with
    no causal mask inside the block. The window's KV comes from the projected backbone taps (`window_kv`)."""

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, window_kv: torch.Tensor,
                window_valid: torch.Tensor) -> torch.Tensor:
        """x [B,K,D] normed draft block at rotation [B,K,rope/2]; window_kv [B,L,hd] with validity [B,L]."""
        _, q = self.queries(x, rotation)
        block_kv = self.window_kv(x, rotation)
        size = x.shape[1]
        entries = torch.cat([window_kv, block_kv], dim=1).unsqueeze(1).expand(-1, size, -1, -1)
        valid = torch.cat([window_valid, window_valid.new_ones(x.shape[0], size)], dim=1)
        o = sparse_attention(q, entries, valid.unsqueeze(1).expand(-1, size, -1), self.attn_sink,
                             self.softmax_scale)
        return self._output(apply_rope_tail(o, rotation, self.rope_dim, inverse=True))


class DeepseekV41MarkovHead(nn.Module):
    """A rank-`dspark_markov_rank` bigram bias: logits += head . embed[previous token]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank, dtype=weight_dtype(torch.bfloat16))
        self.head = DeepseekV41Linear(rank, vocab_size, dtype=torch.float32)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedding = self.embed(token_ids)
        return self.head(embedding), embedding


class DeepseekV41ConfidenceHead(nn.Module):
    """A raw fp32 score per drafted position from the hidden state and the Markov embedding (no sigmoid)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = DeepseekV41Linear(input_dim, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1)).squeeze(-1)


class DeepseekV41DSparkBlock(DeepseekV41Block):
    """One drafter stage: a window-only block with the drafter's own expert count. Stage 0 also projects the
    backbone taps (`main_proj`, `main_norm`); the last stage holds the final norm and the two heads."""

    is_last_stage = False

    def __init__(self, config, spec: LayerSpec, stage: int, quantized: bool, has_vision_bias: bool) -> None:
        # the checkpoint carries an (unused) image bias for the drafter gates too when vision is enabled
        super().__init__(config, spec, quantized, has_vision_bias,
                         n_experts=config.dspark_n_routed_experts or config.n_routed_experts,
                         top_k=config.dspark_num_experts_per_tok or config.num_experts_per_tok)
        self.stage = stage
        if stage == 0:
            self.main_proj = DeepseekV41Linear(config.hidden_size * len(config.dspark_target_layer_ids),
                                               config.hidden_size, storage="fp8" if quantized else "dense")
            self.main_norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        if stage == config.num_nextn_predict_layers - 1:
            self.is_last_stage = True
            self.norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.markov_head = DeepseekV41MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = DeepseekV41ConfidenceHead(config.hidden_size + config.dspark_markov_rank)

    def _make_attention(self, config, spec: LayerSpec, quantized: bool) -> nn.Module:
        return DeepseekV41DSparkAttention(config, spec, quantized)
