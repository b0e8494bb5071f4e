"""`DeepseekV41Model`, the base model: its modules (embeddings, every block, the final norm, the DSpark drafter, the
vision tower, the Engram token map), the forward that prepares what the layers share (`forward_context.py`) and the
layer loop that takes the embeddings through Engram, the DSpark taps and every block, whole or with CED's bounded
replay (`bounded_replay.py`). Hashing the Engram rows, embedding images and drafting are their units' own
(`layers/engram_hashing.py`, `layers/vision_embedding.py`, `layers/dspark.py`)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers.utils.generic import can_return_tuple

from ..cache.cache import DeepseekV41Cache
from ..cache.chunk_store import ChunkStore
from ..config.configuration_deepseek_v41 import DeepseekV41Config
from ..config.layer_plan import LayerPlan
from ..kernels.numerics import weight_dtype
from ..layers.attention import ForwardShare
from ..layers.block import DeepseekV41BackboneBlock
from ..layers.dspark import DeepseekV41DSpark
from ..layers.engram_hashing import DEAD, DeepseekV41EngramHasher
from ..layers.hyper_connections import initial_streams
from ..layers.linear import DeepseekV41RMSNorm
from ..layers.rotary import DeepseekV41Rotary
from ..layers.vision import DeepseekV41VisionAligner, DeepseekV41VisionTower
from ..layers.vision_embedding import embed_image_spans
from ..loading.loader import compressed_token_map
from .bounded_replay import run_bounded_replay
from .forward_context import BackboneRun, DeepseekV41ModelOutput, ForwardContext
from .inputs import check_forward_inputs, dead_positions, forward_ids, forward_store, output_flags, token_positions
from .pretrained import DeepseekV41PreTrainedModel


class DeepseekV41Model(DeepseekV41PreTrainedModel):
    """The DeepSeek-V4.1 backbone without the output head: `embed`, `layers`, `norm`, the DSpark drafter (`mtp`, a
    `DeepseekV41DSpark` whose rings this forward feeds and which `DeepseekV41ForCausalLM` runs with its head), the
    vision tower (`vision`, `aligner`, `image_*`) and the Engram token map (read by the `engram_hasher`). Module
    names are the hub checkpoint's, so `AutoModel` loads the released files as shipped; the CSA2 schedule comes from
    one `LayerPlan` computed at construction."""

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
        self.rotary = DeepseekV41Rotary(text, ((spec.rope_theta, spec.use_yarn)
                                               for spec in self.plan.layers + self.plan.dspark_layers))
        drafting = text.dspark_block_size > 0  # the module keeps the checkpoint's names: mtp.{stage}
        self.mtp = DeepseekV41DSpark(text, self.plan.dspark_layers if drafting else (), quantized, vision,
                                     self.rotary)
        if vision:
            self.vision = DeepseekV41VisionTower(config.vision_config)
            self.aligner = DeepseekV41VisionAligner(config.vision_config, text.hidden_size)
            for name in ("image_start", "image_end", "image_newline"):
                setattr(self, name, nn.Parameter(torch.empty(text.hidden_size, dtype=weight_dtype(torch.bfloat16))))
        self.engram_hasher = None  # token ids -> Engram table rows, for the Engram layers of the plan
        if self.plan.engram_layers:
            self.engram_hasher = DeepseekV41EngramHasher(text, self.plan.engram_layers)
            # saved with the weights; from_pretrained builds it from the tokenizer when a checkpoint lacks it
            self.register_buffer("engram_token_map", self.engram_hasher.default_token_map())
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DeepseekV41Cache | None = None,
        past_key_values: DeepseekV41Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        output_attentions: bool | None = None,
        token_types: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grids: torch.Tensor | None = None,
        prefill_mode: str | None = None,
        **kwargs,
    ) -> DeepseekV41ModelOutput:
        """The final-norm hidden states of every position (see `DeepseekV41ModelOutput`); `token_types` (-1 text,
        >= 0 image span) marks image spans, `prefill_mode` chooses CED's bounded replay for a long prefill.
        `inputs_embeds` replaces the token embeddings; without `input_ids` it needs a config without Engram
        layers and runs without a cache (both read the token ids)."""
        output_hidden_states, output_router_logits = output_flags(self.config, output_attentions,
                                                                  output_hidden_states, output_router_logits)
        if input_ids is not None:
            check_forward_inputs(self.config, input_ids, attention_mask, token_types, pixel_values, cache,
                                 past_key_values)
        input_ids, use_cache = forward_ids(self.config, self.plan, self.training, input_ids, inputs_embeds,
                                           cache or past_key_values, use_cache)
        cache, store, mode = forward_store(self.config, cache if cache is not None else past_key_values, use_cache,
                                           input_ids.shape[1], prefill_mode)
        input_ids, positions, replayed = store.begin_chunk(input_ids, attention_mask, self.embed.weight.dtype)
        if replayed and token_types is not None:
            token_types = torch.cat([torch.full_like(input_ids[:, :replayed], -1), token_types], dim=1)
        context = self.prepare_context(input_ids, attention_mask, token_types, store=store, positions=positions,
                                       replayed=replayed)
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(
            input_ids, token_types, pixel_values, image_grids)
        replay = self.config.text_config.sliding_window
        if mode == "bounded_replay" and cache is not None and replayed == 0 and input_ids.shape[1] > replay:
            run = self.run_backbone_bounded(hidden, context, replay)
        else:
            run = self.run_backbone(hidden, context, output_hidden_states=output_hidden_states)
        tapped = torch.cat(run.taps, dim=-1) if run.taps else None
        if cache is not None and cache.dspark and tapped is not None:
            self.mtp.feed_rings(tapped, run.positions, context.rotations, cache)
        store.commit(input_ids, context.positions, replayed)
        return run.output(self.norm, hidden, tapped, replayed, cache, output_router_logits)

    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """Deprecated (removed in the next release): the drafter's `model.mtp.project_taps(taps)`."""
        warnings.warn("DeepseekV41Model.project_taps is deprecated and will be removed in the next release: use the "
                      "DSpark drafter's model.mtp.project_taps(taps).", FutureWarning, stacklevel=2)
        return self.mtp.project_taps(taps)

    def feed_drafter_rings(self, taps: torch.Tensor, positions: torch.Tensor, rotation: torch.Tensor, cache
                           ) -> None:
        """Deprecated (removed in the next release): the drafter's `model.mtp.feed_rings(...)`."""
        warnings.warn("DeepseekV41Model.feed_drafter_rings is deprecated and will be removed in the next release: use "
                      "the DSpark drafter's model.mtp.feed_rings(taps, positions, rotations, cache).", FutureWarning,
                      stacklevel=2)
        self.mtp.feed_rings(taps, positions, {self.mtp.rope_variant: (rotation, None)}, cache)

    def build_engram_token_map(self, tokenizer) -> None:
        """Build the Engram compressed token map from `tokenizer` (it is saved with the model afterwards)."""
        text = self.config.text_config
        token_map = compressed_token_map(tokenizer, text.vocab_size, text.engram_compressed_vocab_size)
        with torch.no_grad():
            self.engram_token_map.copy_(token_map.to(self.engram_token_map.device))

    def engram_rows(self, input_ids: torch.Tensor, dead: torch.Tensor | None, store=None, replayed: int = 0
                    ) -> torch.Tensor:
        """Global Engram table rows [B,S,n_engram_layers,columns] of every position of `input_ids` (the hasher's,
        over this model's token map); with a forward's `CacheStore`, n-grams reach back into the cached history."""
        store = ChunkStore() if store is None else store
        return self.engram_hasher.rows(self.engram_token_map, input_ids, dead, store, replayed)

    def prepare_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        token_types: torch.Tensor | None = None, record_selection: bool = False,
                        store=None, positions: torch.Tensor | None = None, replayed: int = 0) -> ForwardContext:
        """Everything the layers share for one forward: positions (-1 at padding), RoPE rotations, Engram rows,
        image mask and the per-forward CSA2 share. `store` is the forward's store (a cache's `CacheStore`, whose
        `begin_chunk` gave `positions`) or, by default, a throw-away ChunkStore."""
        store = ChunkStore() if store is None else store
        positions = token_positions(input_ids, attention_mask) if positions is None else positions
        # an all-False padding mask changes nothing; only eager, growing-cache calls read it back to skip it
        image_mask, dead = dead_positions(positions, token_types, store.no_host_reads)
        rotations = self.rotary.rotations(positions)
        engram_rows = None
        if self.engram_hasher is not None:
            engram_rows = self.engram_hasher.rows(self.engram_token_map, input_ids, dead, store, replayed)
            self.engram_hasher.prefetch(self.layers, engram_rows)  # host/mmap tables: gather before the first layer
        else:  # the cache's history still gets a column per token
            store.append_history(torch.full_like(input_ids, DEAD), replayed)
        return ForwardContext(
            positions=positions, rotations=rotations, engram_rows=engram_rows,
            engram_live=None if dead is None else ~dead, image_mask=image_mask,
            share=ForwardShare(record_selection=record_selection, store=store),
        )

    def layer_step(self, index: int, streams: torch.Tensor, pre_mix: torch.Tensor, context: ForwardContext
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run backbone block `index` on streams that already went through its Engram."""
        layer = self.layers[index]
        angles, inv_freq = context.rotations[(layer.spec.rope_theta, layer.spec.use_yarn)]
        return layer(streams, pre_mix, context.image_mask, context.positions, angles, inv_freq, context.share)

    def apply_engram(self, index: int, streams: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        layer = self.layers[index]
        if layer.spec.engram_slot is None:
            return streams
        rows = context.engram_rows[:, :, layer.spec.engram_slot]
        return layer.engram(streams, rows, context.engram_live)

    def run_layers(self, layers: range, streams: torch.Tensor, pre_mix: torch.Tensor, context: ForwardContext,
                   run: BackboneRun, engram_done: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Engram, DSpark tap and block of each layer in `layers`, recording into `run`."""
        for index in layers:
            if index != engram_done:
                streams = self.apply_engram(index, streams, context)
            if self.layers[index].spec.is_dspark_tap:
                run.taps.append(streams.mean(dim=2))
            streams, pre_mix, logits, experts = self.layer_step(index, streams, pre_mix, context)
            run.router_logits.append(logits)
            run.experts.append(experts)
            if run.all_streams is not None:
                run.all_streams += (streams,)
        return streams, pre_mix

    def run_backbone(self, hidden: torch.Tensor, context: ForwardContext, output_hidden_states: bool = False
                     ) -> BackboneRun:
        """Expand the embeddings into the hc streams and run every backbone layer (Engram, DSpark tap, block)."""
        streams, pre_mix = initial_streams(hidden, self.config.text_config.hc_mult)
        run = BackboneRun(streams, pre_mix, (streams,) if output_hidden_states else None, [], [], [],
                          context.positions)
        run.streams, run.pre_mix = self.run_layers(range(len(self.layers)), streams, pre_mix, context, run)
        return run

    def run_backbone_bounded(self, hidden: torch.Tensor, context: ForwardContext, replay: int) -> BackboneRun:
        """CED prefill with bounded replay (`bounded_replay.py`): every token through the encoder layers and the
        first decoder layer's compress step, only the last `replay` tokens through the decoder layers."""
        return run_bounded_replay(self, hidden, context, replay)

    def embed_tokens(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                     pixel_values: torch.Tensor | None = None, image_grids: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Token embeddings with every image span overwritten: delimiters by the learned vectors, image slots by
        the ViT + aligner features in reading order (`embed_image_spans`)."""
        hidden = self.embed(input_ids)
        if pixel_values is None or (pixel_values.shape[0] == 0 and not self.config.vision_enabled):
            return hidden  # the processor gives every text its (possibly empty) image inputs
        if not self.config.vision_enabled:
            raise ValueError("pixel_values were given but this checkpoint has no vision tower (vision_config).")
        return embed_image_spans(hidden, token_types, pixel_values, image_grids, self.vision, self.aligner,
                                 (self.image_start, self.image_newline, self.image_end))
