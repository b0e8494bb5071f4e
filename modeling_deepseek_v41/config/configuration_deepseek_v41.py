"""Configurations of DeepSeek-V4.1-Flash: the hub's multimodal wrapper and its text and vision parts."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PreTrainedConfig

from .config_validation import ValidatedConfig
from .layer_plan import LayerPlan

class DeepseekV41TextConfig(ValidatedConfig, PreTrainedConfig):
    """The text backbone, its CSA2 layer schedule, Engram and the DSpark drafter.

    Key names are the hub's `text_config` names. The defaults are the released DeepSeek-V4.1-Flash. The layer
    schedule is validated on construction (see `LayerPlan`), so an inconsistent config fails here, naming the
    layer and the rule it breaks.
    """

    model_type = "deepseek_v41_text"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 129280,
        hidden_size: int = 5120,
        moe_intermediate_size: int = 2304,
        num_hidden_layers: int = 40,
        num_attention_heads: int = 64,
        num_key_value_heads: int = 1,
        head_dim: int = 512,
        qk_rope_head_dim: int = 64,
        q_lora_rank: int = 1280,
        o_lora_rank: int = 1024,
        o_groups: int = 8,
        hidden_act: str = "silu",
        swiglu_limit: float = 10.0,
        rms_norm_eps: float = 1e-20,
        max_position_embeddings: int = 1048576,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        n_routed_experts: int = 384,
        n_shared_experts: int = 1,
        num_experts_per_tok: int = 6,
        scoring_func: str = "sqrtsoftplus",
        topk_method: str = "noaux_tc",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.5,
        sliding_window: int = 128,
        compress_ratios: list[int] | None = None,
        compress_rope_theta: float = 160000.0,
        kv_source_layer_ids: list[int] | None = None,
        index_source_layer_ids: list[int] | None = None,
        index_n_heads: int = 32,
        index_head_dim: int = 128,
        index_topk: int = 512,
        candidate_source_layer_id: int | None = 20,
        candidate_topk_blocks: int = 2048,
        candidate_block_size: int = 8,
        hc_mult: int = 4,
        hc_sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        engram_layer_ids: list[int] | None = None,
        engram_num_embeddings: list[int] | None = None,
        engram_max_ngram_size: int = 4,
        engram_vocab_size: int = 16000000,
        engram_n_heads: int = 8,
        engram_head_dim: int = 256,
        engram_pad_token_id: int = 2,
        engram_compressed_vocab_size: int = 99092,
        engram_storage: str = "device",
        num_nextn_predict_layers: int = 3,
        dspark_block_size: int = 5,
        dspark_noise_token_id: int = 128799,
        dspark_target_layer_ids: list[int] | None = None,
        dspark_markov_rank: int = 256,
        dspark_n_routed_experts: int = 128,
        dspark_num_experts_per_tok: int = 3,
        router_aux_loss_coef: float = 0.0001,
        prefill_mode: str = "exact",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        output_router_logits: bool = False,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        self.o_lora_rank = o_lora_rank
        self.o_groups = o_groups
        self.hidden_act = hidden_act
        self.swiglu_limit = swiglu_limit
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # transformers keeps rope settings under `rope_parameters` (`rope_scaling` is its alias); accept both names
        rope_scaling = kwargs.pop("rope_parameters", None) or rope_scaling
        self.rope_parameters = dict(rope_scaling) if rope_scaling is not None else {
            "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        }
        self.n_routed_experts = n_routed_experts
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.scoring_func = scoring_func
        self.topk_method = topk_method
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.sliding_window = sliding_window
        self.compress_ratios = list(compress_ratios) if compress_ratios is not None else (
            [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
        )
        self.compress_rope_theta = compress_rope_theta
        self.kv_source_layer_ids = list(kv_source_layer_ids) if kv_source_layer_ids is not None else [2, 8, 14, 20]
        self.index_source_layer_ids = (
            list(index_source_layer_ids) if index_source_layer_ids is not None else [2, 8, 14, 20, 24, 28, 32, 36]
        )
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        # -1 and None both mean "no candidate pre-filtering", as in the reference
        self.candidate_source_layer_id = (
            None if candidate_source_layer_id is None or candidate_source_layer_id < 0 else candidate_source_layer_id
        )
        self.candidate_topk_blocks = candidate_topk_blocks
        self.candidate_block_size = candidate_block_size
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.engram_layer_ids = list(engram_layer_ids) if engram_layer_ids is not None else [1, 14]
        self.engram_num_embeddings = (
            list(engram_num_embeddings) if engram_num_embeddings is not None else [384006168, 384016682]
        )
        self.engram_max_ngram_size = engram_max_ngram_size
        self.engram_vocab_size = engram_vocab_size
        self.engram_n_heads = engram_n_heads
        self.engram_head_dim = engram_head_dim
        self.engram_pad_token_id = engram_pad_token_id
        self.engram_compressed_vocab_size = engram_compressed_vocab_size
        self.engram_storage = engram_storage  # where the Engram tables live (see loading/engram_storage.py)
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.dspark_block_size = dspark_block_size
        self.dspark_noise_token_id = dspark_noise_token_id
        self.dspark_target_layer_ids = (
            list(dspark_target_layer_ids) if dspark_target_layer_ids is not None else [37, 38, 39]
        )
        self.dspark_markov_rank = dspark_markov_rank
        self.dspark_n_routed_experts = dspark_n_routed_experts
        self.dspark_num_experts_per_tok = dspark_num_experts_per_tok
        self.router_aux_loss_coef = router_aux_loss_coef
        # "exact" runs every prompt token through every layer; "bounded_replay" is the CED serving path
        self.prefill_mode = prefill_mode
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.output_router_logits = output_router_logits  # the forward's default for returning the router scores
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("eos_token_id", 1)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        LayerPlan.from_config(self)  # validates the schedule; raises ValueError naming the layer and rule

    @property
    def yarn_factor(self) -> float:
        return float(self.rope_scaling.get("factor", 1.0)) if self.rope_scaling else 1.0

    @property
    def yarn_original_max_position_embeddings(self) -> int:
        """0 disables YaRN, as in the reference."""
        if not self.rope_scaling or self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "yarn":
            return 0
        return int(self.rope_scaling.get("original_max_position_embeddings", 0))


class DeepseekV41VisionConfig(ValidatedConfig, PreTrainedConfig):
    """DeepSeek-ViT and the 3x3 pixel-unshuffle aligner. Key names are the hub's `vision_config` names."""

    model_type = "deepseek_v41_vision"

    def __init__(
        self,
        num_hidden_layers: int = 32,
        hidden_size: int = 1024,
        num_attention_heads: int = 16,
        intermediate_size: int = 2816,
        patch_size: int = 14,
        rope_theta: float = 10000.0,
        downsample_ratio: int = 3,
        max_image_tokens: int = 1024,
        min_pixels: int = 295936,
        max_wh_ratio: float | None = None,
        rms_norm_eps: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.patch_size = patch_size
        self.rope_theta = rope_theta
        self.downsample_ratio = downsample_ratio
        self.max_image_tokens = max_image_tokens
        self.min_pixels = min_pixels
        self.max_wh_ratio = max_wh_ratio
        self.rms_norm_eps = rms_norm_eps
        super().__init__(**kwargs)


class DeepseekV41Config(ValidatedConfig, PreTrainedConfig):
    """The hub's `config.json`: a multimodal wrapper holding `text_config` and `vision_config`.

    `quantization_config` describes how the checkpoint stores its weights (FP8 e4m3 with E8M0 32x32 block scales,
    FP4 routed experts). The model reads those bytes itself, so the description is kept under
    `checkpoint_quantization` (written back as `quantization_config`) and transformers' own FP8 quantizer is not
    engaged. `weight_mode` chooses how weights live in memory: "quantized" (the stored bytes, with the reference's
    FP8 activation QDQ) or "bf16" (dequantized at load, the training default).
    """

    model_type = "deepseek_v41"
    sub_configs = {"text_config": DeepseekV41TextConfig, "vision_config": DeepseekV41VisionConfig}
    keys_to_ignore_at_inference = ["past_key_values"]
    # tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torchrun); the styles are DeepSeek-V4.1's
    # own (tensor_parallel.py): attention heads by o_groups with the grouped output gathered, routed experts
    # sliced across ranks, Engram table rows and head vocabulary rows split; everything else replicated.
    TENSOR_PARALLEL_PLAN = {
        "layers.*.attn": "deepseek_v41_local_heads",
        "layers.*.attn.wq_b": "deepseek_v41_shard_rows",
        "layers.*.attn.wo_a": "deepseek_v41_shard_rows",
        "layers.*.attn.wo_b": "deepseek_v41_gather_input",
        "layers.*.ffn": "deepseek_v41_expert_slices",
        "layers.*.engram.embed": "deepseek_v41_table_rows",
        "mtp.*.attn": "deepseek_v41_local_heads",
        "mtp.*.attn.wq_b": "deepseek_v41_shard_rows",
        "mtp.*.attn.wo_a": "deepseek_v41_shard_rows",
        "mtp.*.attn.wo_b": "deepseek_v41_gather_input",
        "mtp.*.ffn": "deepseek_v41_expert_slices",
    }  # relative to DeepseekV41Model; the head's entry ("lm_head") is DeepseekV41ForCausalLM._tp_plan

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The plan's entries for the parts this config builds (no drafter or Engram entries without them)."""
        text = self.text_config
        return {pattern: style for pattern, style in self.TENSOR_PARALLEL_PLAN.items()
                if (text.num_nextn_predict_layers or not pattern.startswith("mtp."))
                and (text.engram_layer_ids or ".engram." not in pattern)}

    def __init__(
        self,
        text_config: dict | DeepseekV41TextConfig | None = None,
        vision_config: dict | DeepseekV41VisionConfig | None = None,
        image_token_id: int = 129264,
        quantization_config: dict | None = None,
        weight_mode: str | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(text_config, dict):
            text_config = DeepseekV41TextConfig(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV41TextConfig()
        if isinstance(vision_config, dict):
            vision_config = DeepseekV41VisionConfig(**vision_config)
        self.vision_config = vision_config
        self.image_token_id = image_token_id
        if quantization_config is not None and not isinstance(quantization_config, dict):
            quantization_config = quantization_config.to_dict()
        self.checkpoint_quantization = quantization_config
        if weight_mode is None:
            weight_mode = "quantized" if quantization_config is not None else "bf16"
        if weight_mode == "quantized" and quantization_config is None:
            raise ValueError(
                "weight_mode='quantized' needs a checkpoint that stores quantized weights (a quantization_config); "
                "this config has none. Use weight_mode='bf16'."
            )
        self.weight_mode = weight_mode
        kwargs.setdefault("bos_token_id", self.text_config.bos_token_id)
        kwargs.setdefault("eos_token_id", self.text_config.eos_token_id)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def engram_storage(self) -> str:
        """Where the Engram tables live: "device" (parameters, the default), "host" (host memory, pinned when CUDA
        is present) or "mmap" (memory-mapped from the checkpoint file). A placement choice like `device_map`, so
        it is not written to config.json; pass it to `from_pretrained(..., engram_storage="mmap")`."""
        return self.text_config.engram_storage

    @engram_storage.setter
    def engram_storage(self, storage: str) -> None:
        self.text_config.engram_storage = storage  # checked by the text config's own rule

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("checkpoint_quantization", None)
        if self.checkpoint_quantization is not None:
            output["quantization_config"] = dict(self.checkpoint_quantization)
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        """What config.json stores: `engram_storage` is a placement choice (like `device_map`), not written."""
        output = super().to_diff_dict()
        if isinstance(output.get("text_config"), dict):
            output["text_config"].pop("engram_storage", None)
        return output

    def get_text_config(self, *args: Any, **kwargs: Any) -> DeepseekV41TextConfig:
        return self.text_config

    @property
    def vision_enabled(self) -> bool:
        return self.vision_config is not None and self.vision_config.num_hidden_layers > 0


def config_without_dspark(config: DeepseekV41Config) -> DeepseekV41Config:
    """A copy of `config` for a model without the DSpark drafter (no `mtp.*` blocks)."""
    trimmed = copy.deepcopy(config)
    text = trimmed.text_config
    text.compress_ratios = list(text.compress_ratios[: text.num_hidden_layers])
    text.num_nextn_predict_layers = 0
    return trimmed


def config_with_device_engram(config: DeepseekV41Config) -> DeepseekV41Config:
    """`config` with its Engram tables as parameters (what the checkpoint stores, whatever the placement)."""
    if config.text_config.engram_storage == "device":
        return config
    device = copy.deepcopy(config)
    device.engram_storage = "device"
    return device
