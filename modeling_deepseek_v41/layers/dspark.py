"""The DSpark drafter: its window-only blocks under the checkpoint's `mtp.{i}` namespace, its heads, and the module
that owns the stages (`DeepseekV41DSpark`: tap projection, ring feeding, the forward over draft blocks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config.layer_plan import LayerSpec
from ..kernels.numerics import weight_dtype
from ..kernels.sparse_attention import sparse_attention
from .attention import DeepseekV41Attention
from .block import DeepseekV41Block
from .hyper_connections import hc_collapse, initial_streams
from .kv_store import DrafterRings
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

    def window_kv(self, main_x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """This stage's window KV [..., hd] of backbone positions, from their projected taps `main_x` (see
        `DeepseekV41DSpark.project_taps`) at `rotation`."""
        return self.attn.window_kv(main_x, rotation)


class DeepseekV41DSpark(nn.ModuleList):
    """The DSpark drafter: its stages (`DeepseekV41DSparkBlock`s; a ModuleList, so their parameters keep the
    checkpoint's `mtp.{i}` names), the projection of the backbone taps into every stage's window KV, the feeding of
    the cache's drafter rings, and the forward over blocks of draft tokens with the last stage's heads.

    It shares the backbone's token embedding and output head, which the callers apply (the forward takes the block's
    embeddings, `logits` the head) rather than it holding them (the checkpoint stores them once), and the backbone's
    RoPE frequencies (`rotary`, a plain object). Empty when the model drafts nothing."""

    def __init__(self, config, specs: tuple[LayerSpec, ...], quantized: bool, has_vision_bias: bool,
                 rotary) -> None:
        super().__init__(DeepseekV41DSparkBlock(config, spec, stage, quantized, has_vision_bias)
                         for stage, spec in enumerate(specs))
        self.hc_mult = config.hc_mult
        self.rotary = rotary

    def __getitem__(self, index):
        if isinstance(index, slice):  # a plain list: ModuleList would rebuild this class from the stages alone
            return nn.ModuleList(list(self)[index])
        return super().__getitem__(index)

    @property
    def rope_variant(self) -> tuple[float, bool]:
        """The (theta, yarn) every stage rotates with: the key of its angles in a forward's rotations."""
        spec = self[0].spec
        return spec.rope_theta, spec.use_yarn

    @property
    def tap_dtype(self) -> torch.dtype:
        """The dtype of the tap projection's weight (a training forward hands the taps over in it)."""
        return self[0].main_proj.weight.dtype

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """The stages' rotations [*positions.shape, rope/2] at `positions`."""
        return self.rotary.angles(self[0].spec, positions)

    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """The backbone taps [..., n_taps*D] projected into the drafter's width (stage 0's `main_proj`,
        `main_norm`): what every stage's window KV is computed from."""
        first = self[0]
        return first.main_norm(first.main_proj(taps))

    def feed_rings(self, taps: torch.Tensor, positions: torch.Tensor,
                   rotations: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]], rings: DrafterRings
                   ) -> None:
        """Write the window KV of every position the backbone just processed (taps [B,T,n_taps*D] at `positions`
        [B,T], the last T of the forward's) into each stage's ring in `rings` (a cache made with `dspark=True`).
        `rotations` are the forward's own (theta, yarn) -> (angles, inv_freq), so the stages' angles are not
        computed twice."""
        rotation = rotations[self.rope_variant][0][:, -taps.shape[1]:]
        main_x = self.project_taps(taps)
        for stage in self:
            rings.write_window(stage.spec.layer_id, stage.window_kv(main_x, rotation), positions)

    def forward(self, embeddings: torch.Tensor, rotation: torch.Tensor,
                stage_window: Callable[[nn.Module, torch.dtype], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The stages over blocks of tokens, shared by drafting and drafter training: `embeddings` [N,K,D] of the
        block tokens (the backbone's token embedding) at rotation [N,K,rope/2]; `stage_window(stage, dtype)` gives
        each stage's window KV [N,L,hd] and validity [N,L]. Returns the last stage's collapsed hidden state [N,K,D].
        Only tensors and the callable come in: a device map's hook on this module moves every argument with a
        `.to`, and would move a shared embedding module too."""
        streams, pre_mix = initial_streams(embeddings, self.hc_mult)
        for stage in self:
            window_kv, window_valid = stage_window(stage, streams.dtype)
            streams, pre_mix, _, _ = stage(streams, pre_mix, None, rotation, window_kv, window_valid)
        return hc_collapse(streams, pre_mix)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """The draft logits of the forward's `hidden`: the last stage's final norm, then the backbone's output
        `head` (shared, not held: the checkpoint stores it once). No Markov bias: drafting adds it token by token,
        training teacher-forced."""
        return head(self[-1].norm(hidden))

    def markov(self, previous_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's Markov head: the bigram logit bias of each position from the token before it, and
        that token's Markov embedding."""
        return self[-1].markov_head(previous_ids)

    def confidence(self, hidden: torch.Tensor, markov_embeddings: torch.Tensor) -> torch.Tensor:
        """The last stage's raw confidence score per drafted position (no sigmoid)."""
        return self[-1].confidence_head(hidden, markov_embeddings)
