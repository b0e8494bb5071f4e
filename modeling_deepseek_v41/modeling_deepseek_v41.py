"""DeepSeek-V4.1-Flash for causal language modelling, with the hub checkpoint's module names."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.utils import logging

from .cache import DeepseekV41Cache
from .block import DeepseekV41BackboneBlock, DeepseekV41Block
from .checkpoint_layout import checkpoint_has_prefix, validate_checkpoint_folder
from .configuration_deepseek_v41 import DeepseekV41Config, config_without_dspark
from .dspark import DeepseekV41DSparkBlock
from .dspark_drafting import feed_dspark_rings
from .dspark_generation import DSparkCandidateGenerator, dspark_generation_config
from .engram import DeepseekV41Engram, DeepseekV41EngramTable
from .engram_hashing import DEAD, EngramHashLayout, engram_hash_ids, ngram_window
from .forward_share import ForwardShare
from .hyper_connections import hc_collapse
from .layer_plan import LayerPlan
from .loading import compressed_token_map, dequantize_module_weights, load_tokenizer_for_token_map
from .cuda_graph_decode import GenerationGraphs, check_graph_decoding
from .engram_storage import prefetch_engram_rows
from .placement import DeepseekV41PlacementMixin
from .norms import DeepseekV41RMSNorm
from .numerics import quantize_fp4_weight, quantize_fp8_weight, weight_dtype
from .quantized_linear import STORAGE_FP4, STORAGE_FP8, DeepseekV41Linear
from .rope import rope_angles, rope_inv_freq
from .vision import DeepseekV41VisionAligner, DeepseekV41VisionTower, embed_images, merge_image_embeddings


logger = logging.get_logger(__name__)


@dataclass
class DeepseekV41CausalLMOutput(MoeCausalLMOutputWithPast):
    """MoE causal-LM output plus the DSpark tap (mean over streams of each target layer's input, concatenated)
    and the experts every layer chose."""

    dspark_hidden: torch.Tensor | None = None
    router_experts: tuple[torch.Tensor, ...] | None = None


PREFILL_MODES = ("exact", "bounded_replay")


@dataclass
class ForwardContext:
    """Everything the layers of one forward share, computed once before the first layer."""

    positions: torch.Tensor  # [B,S], -1 for padding
    rotations: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]]  # (theta, yarn) -> (angles, inv_freq)
    engram_rows: torch.Tensor | None  # [B,S,n_engram_layers,columns]
    engram_live: torch.Tensor | None  # [B,S] False at image-span and padding positions
    image_mask: torch.Tensor | None  # [B,S] True inside image spans
    share: ForwardShare

    def tail(self, count: int) -> "ForwardContext":
        """The same forward restricted to its last `count` tokens (sharing the CSA2 share)."""
        return ForwardContext(
            positions=self.positions[:, -count:],
            rotations={k: (angles[:, -count:], inv) for k, (angles, inv) in self.rotations.items()},
            engram_rows=None if self.engram_rows is None else self.engram_rows[:, -count:],
            engram_live=None if self.engram_live is None else self.engram_live[:, -count:],
            image_mask=None if self.image_mask is None else self.image_mask[:, -count:],
            share=self.share,
        )


@dataclass
class BackboneRun:
    """What one pass over the backbone layers produced."""

    streams: torch.Tensor  # [B,S,hc,D] output of the last block
    pre_mix: torch.Tensor  # [B,S,hc] collapse weights for the final norm
    all_streams: tuple[torch.Tensor, ...] | None  # embedding streams, then every block's output
    router_logits: list[torch.Tensor]
    experts: list[torch.Tensor]
    taps: list[torch.Tensor]  # DSpark taps in dspark_target_layer_ids order
    positions: torch.Tensor  # [B, T] positions of the tokens the last layers ran on (the taps' positions)


class DeepseekV41PreTrainedModel(DeepseekV41PlacementMixin, PreTrainedModel):
    """Weight initialisation and the transformers integration shared by the DeepSeek-V4.1 models."""

    config_class = DeepseekV41Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV41BackboneBlock", "DeepseekV41DSparkBlock"]
    _keys_to_ignore_on_load_missing = [r"^engram_token_map$"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.text_config.initializer_range
        if isinstance(module, DeepseekV41Linear):
            if module.storage == STORAGE_FP8:
                weight, scale = quantize_fp8_weight(torch.randn(module.out_features, module.in_features) * std)
                init.copy_(module.weight, weight)
                init.copy_(module.scale, scale)
            elif module.storage == STORAGE_FP4:
                weight, scale = quantize_fp4_weight(torch.randn(module.out_features, module.in_features) * std)
                init.copy_(module.weight, weight)
                init.copy_(module.scale, scale)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV41EngramTable):
            if module.quantized:
                values = torch.randn(module.weight.shape) * std
                init.copy_(module.weight, values.to(torch.float8_e4m3fn))
                init.copy_(module.scale, torch.ones(module.scale.shape, dtype=torch.float8_e8m0fnu))
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41Block):
            for sublayer in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{sublayer}_fn"), mean=0.0, std=std)
                init.zeros_(getattr(module, f"hc_{sublayer}_base"))
                init.ones_(getattr(module, f"hc_{sublayer}_scale"))
            init.zeros_(module.attn.attn_sink)
            init.normal_(module.ffn.gate.weight, mean=0.0, std=std)
            init.zeros_(module.ffn.gate.bias)
            if module.ffn.gate.bias_vl is not None:
                init.zeros_(module.ffn.gate.bias_vl)
        elif isinstance(module, DeepseekV41ForCausalLM):
            if hasattr(module, "engram_token_map"):
                init.constant_(module.engram_token_map, -1)
            for name in ("image_start", "image_end", "image_newline"):
                if hasattr(module, name):
                    init.normal_(getattr(module, name), mean=0.0, std=std)


class DeepseekV41ForCausalLM(DeepseekV41PreTrainedModel, GenerationMixin):
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
        self._rope_tables = {
            (spec.rope_theta, spec.use_yarn): None for spec in self.plan.layers + self.plan.dspark_layers
        }
        self._device_constants: dict[tuple, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._cuda_graphs_requested, self._generation_graphs = False, None  # set for one generate() call
        self.post_init()

    # -- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' loader, plus what the hub checkpoint needs: the Engram token map built from the folder's
        tokenizer when the weights do not carry it, and `weight_mode="bf16"` dequantization after loading."""
        hub_kwargs = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder")
                      if k in kwargs}
        if os.path.isdir(pretrained_model_name_or_path) and not kwargs.get("ignore_mismatched_sizes"):
            config = kwargs.get("config")
            if not isinstance(config, DeepseekV41Config):
                config = cls.config_class.from_pretrained(pretrained_model_name_or_path)
            if config.text_config.num_nextn_predict_layers and not checkpoint_has_prefix(
                    pretrained_model_name_or_path, "mtp."):
                # a checkpoint shipped without the drafter loads without it, rather than with random draft weights
                logger.warning("The checkpoint has no DSpark drafter weights (mtp.*): loading without the drafter.")
                config = config_without_dspark(config)
                kwargs["config"] = config
            validate_checkpoint_folder(pretrained_model_name_or_path, config)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if hasattr(model, "engram_token_map") and bool((model.engram_token_map < 0).any()):
            model.build_engram_token_map(load_tokenizer_for_token_map(pretrained_model_name_or_path, **hub_kwargs))
        if model.config.weight_mode == "bf16" and model.quantized:
            model.dequantize_weights()
        return loaded

    def build_engram_token_map(self, tokenizer) -> None:
        """Build the Engram compressed token map from `tokenizer` (it is saved with the model afterwards)."""
        text = self.config.text_config
        token_map = compressed_token_map(tokenizer, text.vocab_size, text.engram_compressed_vocab_size)
        with torch.no_grad():
            self.engram_token_map.copy_(token_map.to(self.engram_token_map.device))

    def dequantize_weights(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Switch to the bf16 weight mode: dequantize every FP8/FP4 weight exactly, drop the scales, and drop the
        checkpoint's quantization description from the config (saving then writes dense weights)."""
        dequantize_module_weights(self, dtype)
        self.quantized = False
        self.config.checkpoint_quantization = None
        self.config.weight_mode = "bf16"

    # -- transformers plumbing -------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    # -- generation ------------------------------------------------------------------------------------------
    @property
    def has_dspark(self) -> bool:
        """Whether the DSpark drafter's weights (`mtp.*`) are part of this model."""
        return len(self.mtp) > 0

    def generate(self, *args, **kwargs):
        """transformers' generate(), plus DSpark speculative decoding: `use_dspark=True` (a generation-config
        field, also settable in generation_config.json) and `dspark_confidence_threshold`. Afterwards
        `model.last_generation_stats` holds the run's measured speed, cache size and draft acceptance.
        `cuda_graphs=True` replays the one-token decode steps from a CUDA graph (greedy or sampling, batch of any
        size, on a CUDA device; not with DSpark or beam search)."""
        cuda_graphs = bool(kwargs.pop("cuda_graphs", False))
        if cuda_graphs:
            check_graph_decoding(self)
        use_dspark = kwargs.pop("use_dspark", None)
        threshold = kwargs.pop("dspark_confidence_threshold", None)
        base = kwargs.pop("generation_config", None)
        if use_dspark is not None or threshold is not None or getattr(base or self.generation_config, "use_dspark",
                                                                          False):
            config = dspark_generation_config(self, base, use_dspark, threshold)
            kwargs = config.update(**kwargs)  # generation settings go into the copy, the rest stay model inputs
            kwargs["generation_config"] = config
        elif base is not None:
            kwargs["generation_config"] = base
        self._generation_cache, self._dspark_generator = None, None
        self._cuda_graphs_requested, self._generation_graphs = cuda_graphs, None
        start = time.perf_counter()
        try:
            output = super().generate(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            cache, generator = self._generation_cache, self._dspark_generator
            if self._generation_graphs is not None:
                self._generation_graphs.close()
            self._generation_cache, self._dspark_generator = None, None
            self._cuda_graphs_requested, self._generation_graphs = False, None
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        prompt = args[0] if args else kwargs.get("input_ids")
        new_tokens = sequences.numel() - (prompt.numel() if isinstance(prompt, torch.Tensor) else 0)
        self.last_generation_stats = {
            "new_tokens": int(new_tokens), "seconds": elapsed, "tokens_per_second": new_tokens / max(elapsed, 1e-9),
            "cache_global_bytes_per_token": cache.global_bytes_per_token() if cache is not None else None,
            "dspark_mean_accepted_length": generator.mean_accepted_length if generator is not None else None,
            "dspark_rounds": generator.rounds if generator is not None else None,
        }
        return output

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                                 model_kwargs, *args, **kwargs):
        if getattr(generation_config, "use_dspark", False):
            self._dspark_generator = DSparkCandidateGenerator(self, generation_config, logits_processor)
            return self._dspark_generator
        return super()._get_candidate_generator(generation_config, input_ids, inputs_tensor, logits_processor,
                                                model_kwargs, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """generate() gets a DeepseekV41Cache (the dynamic caches of transformers cannot hold CSA2 pools)."""
        dspark = bool(getattr(generation_config, "use_dspark", False))
        if self._cuda_graphs_requested:
            if dspark or generation_config.num_beams > 1:
                raise ValueError("cuda_graphs=True replays one-token steps: it cannot be combined with use_dspark "
                                 "or beam search (num_beams > 1).")
            if generation_config.use_cache is False:
                raise ValueError("cuda_graphs=True needs the cache: do not combine it with use_cache=False.")
        if model_kwargs.get("cache") is not None:
            cache = self._generation_cache = model_kwargs["cache"]
            cache._is_user_defined = True
            if dspark and not cache.dspark:
                raise ValueError("use_dspark needs a cache created with DeepseekV41Cache(config, dspark=True).")
            if self._cuda_graphs_requested and cache.dspark:
                raise ValueError("cuda_graphs=True needs a cache without DSpark rings (DeepseekV41Cache(config)).")
        elif generation_config.use_cache is False:
            if dspark:
                raise ValueError("use_dspark needs the cache: do not combine it with use_cache=False.")
            return
        else:
            model_kwargs["cache"] = self._generation_cache = DeepseekV41Cache(self.config, dspark=dspark)
        if self._cuda_graphs_requested:
            self._generation_graphs = GenerationGraphs(self, self._generation_cache, generation_config.max_length)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs) -> dict:
        """Images and their token types belong to the prefill only; later steps feed text tokens."""
        is_first = kwargs.get("is_first_iteration", False)
        cache = kwargs.get("cache")
        if cache is not None and cache.pending_replay:
            cache.check_extends(input_ids)
        continuing = cache is not None and cache.get_seq_length() > 0 and not is_first
        token_types = kwargs.pop("token_types", None)
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        if continuing:
            for key in ("pixel_values", "image_grids"):
                model_inputs.pop(key, None)
        elif token_types is not None:
            width = model_inputs["input_ids"].shape[1]
            model_inputs["token_types"] = token_types[:, -width:]
        return model_inputs

    # -- forward pieces --------------------------------------------------------------------------------------
    def _on_device(self, key: tuple, device: torch.device, build) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """A host-built constant copied to `device` once: a step then copies nothing from the host (which a
        CUDA graph could not capture)."""
        cached = self._device_constants.get((key, device))
        if cached is None:
            built = build()
            cached = tuple(t.to(device) for t in built) if isinstance(built, tuple) else built.to(device)
            self._device_constants[(key, device)] = cached
        return cached

    def _inv_freq(self, theta: float, yarn: bool, device: torch.device) -> torch.Tensor:
        text = self.config.text_config
        scaling = text.rope_scaling or {}
        return self._on_device(("inv_freq", theta, yarn), device, lambda: rope_inv_freq(
            text.qk_rope_head_dim, theta, text.yarn_factor if yarn else 1.0,
            text.yarn_original_max_position_embeddings if yarn else 0,
            float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1)),
        ))

    def engram_rows(self, input_ids: torch.Tensor, dead: torch.Tensor | None, cache=None, replayed: int = 0
                    ) -> torch.Tensor:
        """Global Engram table rows [B,S,n_engram_layers,columns] of every position of `input_ids`; with a cache,
        n-grams reach back into the cached history."""
        token_map = self.engram_token_map
        static = cache is not None and cache.is_static
        if not torch.compiler.is_compiling() and not static and bool((token_map < 0).any()):  # a host read
            raise RuntimeError(
                "The Engram compressed token map has not been built. Load the model with from_pretrained from a "
                "folder that has the tokenizer files, or call model.build_engram_token_map(tokenizer)."
            )
        text = self.config.text_config
        compressed = token_map[input_ids]
        if dead is not None:
            compressed = compressed.masked_fill(dead, DEAD)
        history = cache.append_history(compressed, replayed) if cache is not None else compressed
        pad = token_map[text.engram_pad_token_id]
        shifted = ngram_window(history, pad, text.engram_max_ngram_size, input_ids.shape[1])
        primes, offsets, multipliers = self._on_device(("engram_layout",), input_ids.device,
                                                       lambda: self.engram_layout.tensors)
        return engram_hash_ids(shifted, primes, offsets, multipliers)

    def prepare_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        token_types: torch.Tensor | None = None, record_selection: bool = False,
                        cache=None, positions: torch.Tensor | None = None, replayed: int = 0) -> ForwardContext:
        """Everything the layers share for one forward: positions (-1 at padding), RoPE rotations, Engram rows,
        image mask and the per-forward CSA2 share. With a cache, `positions` come from `cache.begin_chunk`."""
        batch, seq = input_ids.shape
        device = input_ids.device
        if positions is None:
            if attention_mask is None:
                positions = torch.arange(seq, device=device).expand(batch, seq)
            else:
                mask = attention_mask[:, -seq:].to(torch.bool)
                positions = torch.where(mask, mask.long().cumsum(-1) - 1, -1)
        padding = positions < 0
        # an all-False mask changes nothing; only eager, growing-cache calls read it back to skip the masking
        keep = torch.compiler.is_compiling() or (cache is not None and cache.is_static)
        padding = padding if keep or bool(padding.any()) else None
        image_mask = token_types >= 0 if token_types is not None else None
        dead = image_mask
        if padding is not None:
            dead = padding if dead is None else dead | padding
        rotations = {}
        for theta, yarn in self._rope_tables:
            inv_freq = self._inv_freq(theta, yarn, device)
            rotations[(theta, yarn)] = (rope_angles(positions.clamp_min(0), inv_freq), inv_freq)
        engram_rows = self.engram_rows(input_ids, dead, cache, replayed) if self.plan.engram_layers else None
        if engram_rows is not None:  # host/mmap tables: start gathering their rows before the first layer
            prefetch_engram_rows(self, engram_rows)
        if cache is not None and not self.plan.engram_layers:
            cache.append_history(torch.full_like(input_ids, DEAD), replayed)
        return ForwardContext(
            positions=positions, rotations=rotations, engram_rows=engram_rows,
            engram_live=None if dead is None else ~dead, image_mask=image_mask,
            share=ForwardShare(record_selection=record_selection, cache=cache),
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

    def _initial_streams(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings copied into the hc streams, and the one-hot collapse weights of the first block."""
        streams = hidden.unsqueeze(2).repeat(1, 1, self.config.text_config.hc_mult, 1)
        pre_mix = torch.zeros(*streams.shape[:3], dtype=torch.float64 if streams.dtype == torch.float64
                              else torch.float32, device=streams.device)
        pre_mix[..., 0] = 1.0
        return streams, pre_mix

    def _run_layers(self, layers: range, streams: torch.Tensor, pre_mix: torch.Tensor, context: ForwardContext,
                    run: "BackboneRun", engram_done: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
                     ) -> "BackboneRun":
        """Expand the embeddings into the hc streams and run every backbone layer (Engram, DSpark tap, block)."""
        streams, pre_mix = self._initial_streams(hidden)
        run = BackboneRun(streams, pre_mix, (streams,) if output_hidden_states else None, [], [], [],
                          context.positions)
        run.streams, run.pre_mix = self._run_layers(range(len(self.layers)), streams, pre_mix, context, run)
        return run

    def run_backbone_bounded(self, hidden: torch.Tensor, context: ForwardContext, replay: int) -> "BackboneRun":
        """CED prefill with bounded replay: every token runs the encoder layers and the first decoder layer's
        compressor (the decoder's pool depends on nothing else); only the last `replay` tokens run the decoder
        layers, whose windows see only the replayed segment."""
        decoder = self.plan.decoder_start
        streams, pre_mix = self._initial_streams(hidden)
        run = BackboneRun(streams, pre_mix, None, [], [], [], context.positions)
        streams, pre_mix = self._run_layers(range(decoder), streams, pre_mix, context, run)
        layer = self.layers[decoder]
        streams = self.apply_engram(decoder, streams, context)
        _, inv_freq = context.rotations[(layer.spec.rope_theta, layer.spec.use_yarn)]
        layer.compress_only(streams, pre_mix, context.positions, inv_freq, context.share)
        tail = context.tail(replay)
        tail.share.pool_ready.add(decoder)
        tail.share.window_floor = torch.where(tail.positions >= 0, tail.positions,
                                              torch.iinfo(tail.positions.dtype).max).amin(dim=1)
        run.taps = [tap[:, -replay:] for tap in run.taps]
        run.streams, run.pre_mix = self._run_layers(range(decoder, len(self.layers)), streams[:, -replay:],
                                                    pre_mix[:, -replay:], tail, run, engram_done=decoder)
        run.positions = tail.positions
        return run

    def embed_tokens(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                     pixel_values: torch.Tensor | None = None, image_grids: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Token embeddings with every image span overwritten: delimiters by the learned vectors, image slots by
        the ViT + aligner features in reading order."""
        hidden = self.embed(input_ids)
        if pixel_values is None:
            return hidden
        if not self.config.vision_enabled:
            raise ValueError("pixel_values were given but this checkpoint has no vision tower (vision_config).")
        if token_types is None or image_grids is None:
            raise ValueError("Images need the processor's token_types and image_grids next to pixel_values.")
        image_embeds = embed_images(self.vision, self.aligner, pixel_values, image_grids)
        return merge_image_embeddings(hidden, token_types, image_embeds, self.image_start, self.image_newline,
                                      self.image_end)

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
        if input_ids is None:
            raise ValueError("DeepseekV41ForCausalLM needs input_ids: the Engram hash is computed from token ids.")
        cache = cache if cache is not None else past_key_values
        graphs = self._generation_graphs
        if graphs is not None and graphs.handles(cache, input_ids, pixel_values) and labels is None:
            return DeepseekV41CausalLMOutput(logits=graphs.step(input_ids), cache=cache)
        if cache is None and use_cache:
            cache = DeepseekV41Cache(self.config)
        if cache is not None:
            if not isinstance(cache, DeepseekV41Cache):
                raise TypeError(f"DeepseekV41ForCausalLM needs a DeepseekV41Cache, got {type(cache).__name__}.")
            cache.check_compatible(self.config.text_config)
        past = cache.get_seq_length() if cache is not None else 0
        max_positions = self.config.text_config.max_position_embeddings
        if past + input_ids.shape[1] > max_positions:
            raise ValueError(
                f"Sequence of {past + input_ids.shape[1]} tokens exceeds max_position_embeddings ({max_positions})."
            )
        positions, replayed = None, 0
        if cache is not None:
            input_ids, positions, replayed = cache.begin_chunk(input_ids, attention_mask, self.embed.weight.dtype)
            if replayed and token_types is not None:
                token_types = torch.cat([torch.full_like(input_ids[:, :replayed], -1), token_types], dim=1)
        context = self.prepare_context(input_ids, attention_mask, token_types, cache=cache, positions=positions,
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
        if cache is not None and cache.dspark and taps:
            spec = self.mtp[0].spec
            rotation = context.rotations[(spec.rope_theta, spec.use_yarn)][0][:, -taps[0].shape[1]:]
            feed_dspark_rings(self, torch.cat(taps, dim=-1), run.positions, rotation, cache)
        if cache is not None:
            cache.commit(input_ids, context.positions, replayed)
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
