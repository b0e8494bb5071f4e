"""DeepSeek-V4.1-Flash for causal language modelling, with the hub checkpoint's module names."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from ..cache.cache import DeepseekV41Cache
from ..cache.chunk_store import ChunkStore
from ..config.configuration_deepseek_v41 import DeepseekV41Config
from ..config.layer_plan import LayerPlan
from ..kernels.linear import DeepseekV41Linear, DeepseekV41RMSNorm
from ..kernels.numerics import weight_dtype
from ..layers.block import DeepseekV41BackboneBlock
from ..layers.dspark import DeepseekV41DSparkBlock
from ..layers.engram_hashing import EngramHashLayout
from ..layers.hyper_connections import hc_collapse
from ..layers.rotary import DeepseekV41Rotary
from ..layers.vision import DeepseekV41VisionAligner, DeepseekV41VisionTower
from .backbone import DeepseekV41BackboneMixin
from .dspark import feed_dspark_rings
from .generation import DeepseekV41GenerationMixin
from .inputs import check_forward_inputs
from .pretrained import DeepseekV41PreTrainedModel


@dataclass
class DeepseekV41CausalLMOutput(MoeCausalLMOutputWithPast):
    """MoE causal-LM output plus the DSpark tap (mean over streams of each target layer's input, concatenated)
    and the experts every layer chose."""

    dspark_hidden: torch.Tensor | None = None
    router_experts: tuple[torch.Tensor, ...] | None = None


PREFILL_MODES = ("exact", "bounded_replay")


class DeepseekV41ForCausalLM(DeepseekV41BackboneMixin, DeepseekV41GenerationMixin, DeepseekV41PreTrainedModel):
    """The DeepSeek-V4.1 backbone with its head, DSpark drafter blocks and (when configured) vision tower.

    Module names are the hub checkpoint's (`embed`, `layers.{L}.attn.wq_a`, `head`, `mtp.{i}`, ...), so the
    released checkpoint loads as shipped. The CSA2 schedule comes from one `LayerPlan` computed at construction.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__(config)
        text = config.text_config
        self.plan = LayerPlan.from_config(text)
        quantized = config.checkpoint_quantization is not None
        self.quantized = quantized
        vision = config.vision_enabled
        self.embed = nn.Embedding(text.vocab_size, text.hidden_size, dtype=weight_dtype(torch.bfloat16))
        self.layers = nn.ModuleList(
            DeepseekV41BackboneBlock(text, spec, quantized, has_vision_bias=vision) for spec in self.plan.layers
        )
        self.norm = DeepseekV41RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.head = DeepseekV41Linear(text.hidden_size, text.vocab_size, dtype=torch.float32)
        drafting = text.dspark_block_size > 0
        self.mtp = nn.ModuleList(
            DeepseekV41DSparkBlock(text, spec, stage, quantized, vision)
            for stage, spec in enumerate(self.plan.dspark_layers if drafting else ())
        )
        if vision:
            self.vision = DeepseekV41VisionTower(config.vision_config)
            self.aligner = DeepseekV41VisionAligner(config.vision_config, text.hidden_size)
            for name in ("image_start", "image_end", "image_newline"):
                setattr(self, name, nn.Parameter(torch.empty(text.hidden_size, dtype=weight_dtype(torch.bfloat16))))
        if self.plan.engram_layers:
            self.engram_layout = EngramHashLayout.from_config(text)
            # built from the tokenizer when a checkpoint does not carry it; -1 marks "not built yet"
            self.register_buffer("engram_token_map", torch.full((text.vocab_size,), -1, dtype=torch.int64))
        self.rotary = DeepseekV41Rotary(text, ((spec.rope_theta, spec.use_yarn)
                                               for spec in self.plan.layers + self.plan.dspark_layers))
        self.post_init()

    # -- transformers plumbing -------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        token_types: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grids: torch.Tensor | None = None,
        prefill_mode: str | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> DeepseekV41CausalLMOutput:
        """Logits for every position (or the last `logits_to_keep`), a shifted cross-entropy loss with `labels`,
        and router logits with `output_router_logits`. `token_types` (-1 text, >= 0 image span) marks image spans."""
        check_forward_inputs(self.config, input_ids, attention_mask, token_types, pixel_values, cache, past_key_values)
        if input_ids is None:
            raise ValueError("DeepseekV41ForCausalLM needs input_ids: the Engram hash is computed from token ids.")
        cache = cache if cache is not None else past_key_values
        run = cache.generation_run if isinstance(cache, DeepseekV41Cache) else None
        graphs = run.graphs if run is not None else None
        if graphs is not None and graphs.handles(cache, input_ids, pixel_values) and labels is None:
            return DeepseekV41CausalLMOutput(logits=graphs.step(input_ids), cache=cache)
        if cache is None and use_cache:
            cache = DeepseekV41Cache(self.config)
        if cache is not None:
            if not isinstance(cache, DeepseekV41Cache):
                raise TypeError(f"DeepseekV41ForCausalLM needs a DeepseekV41Cache, got {type(cache).__name__}.")
            cache.check_compatible(self.config.text_config)
        store = cache if cache is not None else ChunkStore()  # without a cache, the layers' KV lives one forward
        past = store.get_seq_length()
        max_positions = self.config.text_config.max_position_embeddings
        if past + input_ids.shape[1] > max_positions:
            raise ValueError(
                f"Sequence of {past + input_ids.shape[1]} tokens exceeds max_position_embeddings ({max_positions})."
            )
        input_ids, positions, replayed = store.begin_chunk(input_ids, attention_mask, self.embed.weight.dtype)
        if replayed and token_types is not None:
            token_types = torch.cat([torch.full_like(input_ids[:, :replayed], -1), token_types], dim=1)
        context = self.prepare_context(input_ids, attention_mask, token_types, store=store, positions=positions,
                                       replayed=replayed)
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(
            input_ids, token_types, pixel_values, image_grids)
        mode = prefill_mode or self.config.text_config.prefill_mode
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {mode!r}.")
        replay = self.config.text_config.sliding_window
        if mode == "bounded_replay" and cache is not None and replayed == 0 and input_ids.shape[1] > replay:
            run = self.run_backbone_bounded(hidden, context, replay)
        else:
            run = self.run_backbone(hidden, context, output_hidden_states=bool(output_hidden_states))
        streams, pre_mix = run.streams, run.pre_mix
        all_streams, router_logits, router_experts, taps = run.all_streams, run.router_logits, run.experts, run.taps
        if store.dspark and taps:
            spec = self.mtp[0].spec
            rotation = context.rotations[(spec.rope_theta, spec.use_yarn)][0][:, -taps[0].shape[1]:]
            feed_dspark_rings(self, torch.cat(taps, dim=-1), run.positions, rotation, store)
        store.commit(input_ids, context.positions, replayed)
        if replayed:  # the replayed tokens only rebuilt windows: report the caller's tokens
            streams, pre_mix = streams[:, replayed:], pre_mix[:, replayed:]
            taps = [tap[:, replayed:] for tap in taps]
        final = hc_collapse(streams, pre_mix)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.head(self.norm(final)[:, kept])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.text_config.vocab_size, **kwargs)
        return DeepseekV41CausalLMOutput(
            loss=loss, logits=logits, hidden_states=all_streams, cache=cache,
            router_logits=tuple(router_logits) if output_router_logits else None,
            dspark_hidden=torch.cat(taps, dim=-1) if taps else None,
            router_experts=tuple(router_experts) if output_router_logits else None,
        )
