"""The domain of every DeepSeek-V4.1 config field, checked when a config is built and when a field is set.

`ValidatedConfig` is a mixin for the three config classes. Its `__post_init__` (which transformers'
`PreTrainedConfig.__init__` calls once every field is set) checks every rule; its `__setattr__` re-checks a field's
own rule whenever the field is assigned afterwards, which is how `from_pretrained(..., weight_mode=...)` and
`from_dict(..., **kwargs)` set values. Rules that relate two fields are checked at construction only, so code that
changes related fields one after the other is not refused halfway. Each error is a ValueError naming the config,
the field, the value and the rule. This module reads attributes only and imports nothing from the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

QUANT_GROUP = 32  # FP8/FP4 scales and the FP8 activation QDQ cover groups of 32 values along a linear's input
TEXT_MODEL_TYPE = "deepseek_v41_text"
VISION_MODEL_TYPE = "deepseek_v41_vision"
WRAPPER_MODEL_TYPE = "deepseek_v41"
PREFILL_MODES = ("exact", "bounded_replay")  # every prompt token through every layer, or CED's serving path

Rule = tuple[Callable[[Any], bool], str]  # (accepts the value, what the value must be)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def int_at_least(low: int) -> Rule:
    if low == 1:
        return (lambda v: _is_int(v) and v >= 1), "a positive integer"
    return (lambda v: _is_int(v) and v >= low), f"an integer >= {low}"


def int_multiple_of(step: int, why: str) -> Rule:
    return (lambda v: _is_int(v) and v >= step and v % step == 0), f"a positive multiple of {step} ({why})"


def real_above(low: float, inclusive: bool = False) -> Rule:
    if inclusive:
        return (lambda v: _is_real(v) and v >= low), f"a finite number >= {low}"
    return (lambda v: _is_real(v) and v > low), f"a finite number > {low}"


def one_of(*choices: Any) -> Rule:
    return (lambda v: isinstance(v, str) and v in choices), f"one of {choices}"


def optional(rule: Rule) -> Rule:
    accepts, what = rule
    return (lambda v: v is None or accepts(v)), f"None or {what}"


def int_list(low: int = 0) -> Rule:
    return (lambda v: isinstance(v, (list, tuple)) and all(_is_int(i) and i >= low for i in v),
            f"a list of integers >= {low}")


BOOL: Rule = (lambda v: isinstance(v, bool), "True or False")
POSITIVE = int_at_least(1)
NON_NEGATIVE = int_at_least(0)

TEXT_RULES: dict[str, Rule] = {
    "vocab_size": POSITIVE,
    "hidden_size": POSITIVE,
    "moe_intermediate_size": POSITIVE,
    "num_hidden_layers": POSITIVE,
    "num_attention_heads": POSITIVE,
    "num_key_value_heads": ((lambda v: v == 1 and _is_int(v)), "1 (one KV head is shared by every query head)"),
    "head_dim": int_multiple_of(QUANT_GROUP, "the window KV is FP8 in groups of 32 in every weight mode"),
    "qk_rope_head_dim": ((lambda v: _is_int(v) and v >= 2 and v % 2 == 0),
                         "a positive even integer (RoPE rotates pairs of features)"),
    "q_lora_rank": POSITIVE,
    "o_lora_rank": POSITIVE,
    "o_groups": POSITIVE,
    "hidden_act": one_of("silu"),
    "swiglu_limit": real_above(0.0, inclusive=True),
    "rms_norm_eps": real_above(0.0),
    "max_position_embeddings": POSITIVE,
    "rope_theta": real_above(0.0),
    "n_routed_experts": POSITIVE,
    "n_shared_experts": ((lambda v: v == 1 and _is_int(v)), "1 (every MoE layer has exactly one shared expert)"),
    "num_experts_per_tok": POSITIVE,
    "scoring_func": one_of("sqrtsoftplus", "sigmoid", "softmax"),
    "topk_method": one_of("noaux_tc"),
    "norm_topk_prob": BOOL,
    "routed_scaling_factor": real_above(0.0),
    "sliding_window": POSITIVE,
    "compress_ratios": int_list(0),
    "compress_rope_theta": real_above(0.0),
    "kv_source_layer_ids": int_list(0),
    "index_source_layer_ids": int_list(0),
    "index_n_heads": POSITIVE,
    "index_head_dim": int_multiple_of(QUANT_GROUP, "index queries and keys are FP4 in groups of 32"),
    "index_topk": POSITIVE,
    "candidate_source_layer_id": optional(NON_NEGATIVE),
    "candidate_topk_blocks": POSITIVE,
    "candidate_block_size": POSITIVE,
    "hc_mult": POSITIVE,
    "hc_sinkhorn_iters": POSITIVE,
    "hc_eps": real_above(0.0, inclusive=True),
    "engram_layer_ids": int_list(0),
    "engram_num_embeddings": int_list(1),
    "engram_max_ngram_size": int_at_least(2),
    "engram_vocab_size": POSITIVE,
    "engram_n_heads": POSITIVE,
    "engram_head_dim": POSITIVE,
    "engram_pad_token_id": NON_NEGATIVE,
    "engram_compressed_vocab_size": POSITIVE,
    "engram_storage": one_of("device", "host", "mmap"),
    "num_nextn_predict_layers": NON_NEGATIVE,
    "dspark_block_size": NON_NEGATIVE,
    "dspark_noise_token_id": NON_NEGATIVE,
    "dspark_target_layer_ids": int_list(0),
    "dspark_markov_rank": POSITIVE,
    "dspark_n_routed_experts": NON_NEGATIVE,
    "dspark_num_experts_per_tok": NON_NEGATIVE,
    "router_aux_loss_coef": real_above(0.0, inclusive=True),
    "prefill_mode": one_of(*PREFILL_MODES),
    "initializer_range": real_above(0.0, inclusive=True),
}

VISION_RULES: dict[str, Rule] = {
    "num_hidden_layers": NON_NEGATIVE,  # 0: no vision tower
    "hidden_size": POSITIVE,
    "num_attention_heads": POSITIVE,
    "intermediate_size": POSITIVE,
    "patch_size": POSITIVE,
    "rope_theta": real_above(0.0),
    "downsample_ratio": POSITIVE,
    "max_image_tokens": (int_at_least(4)[0], "an integer >= 4 (the smallest image span: start, one cell, newline, "
                                             "end)"),
    "min_pixels": NON_NEGATIVE,
    "max_wh_ratio": optional(real_above(0.0)),
    "rms_norm_eps": real_above(0.0),
}

WRAPPER_RULES: dict[str, Rule] = {
    "weight_mode": one_of("quantized", "bf16"),
    "image_token_id": NON_NEGATIVE,
}

RULES = {TEXT_MODEL_TYPE: TEXT_RULES, VISION_MODEL_TYPE: VISION_RULES, WRAPPER_MODEL_TYPE: WRAPPER_RULES}


def _fail(config: Any, message: str) -> None:
    raise ValueError(f"{type(config).__name__}: {message}")


def check_field(config: Any, name: str, value: Any) -> None:
    """Raise ValueError when `value` is outside the domain of `config`'s field `name` (unknown names pass)."""
    rule = RULES.get(getattr(config, "model_type", None), {}).get(name)
    if rule is not None and not rule[0](value):
        _fail(config, f"{name} must be {rule[1]}, got {value!r}.")


def _require(config: Any, condition: bool, message: str) -> None:
    if not condition:
        _fail(config, message)


def _check_rope(config: Any) -> None:
    rope = getattr(config, "rope_parameters", None)
    _require(config, rope is None or isinstance(rope, dict), f"rope_parameters must be a dict or None, got {rope!r}.")
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    _require(config, kind in ("default", "yarn"),
             f"rope_parameters['rope_type'] is {kind!r}, but DeepSeek-V4.1 supports 'yarn' (the released scaling) or "
             "'default' (none): other scalings would change the RoPE of compressed keys already in a cache.")
    if kind != "yarn":
        return
    factor = rope.get("factor", 1.0)
    _require(config, _is_real(factor) and factor > 0, f"rope_parameters['factor'] must be a finite number > 0 for "
                                                      f"YaRN, got {factor!r}.")
    original = rope.get("original_max_position_embeddings", 0)
    _require(config, _is_int(original) and original >= 0, "rope_parameters['original_max_position_embeddings'] "
                                                          f"must be an integer >= 0 (0 disables YaRN), got {original!r}.")


def _check_fields(config: Any, rules) -> None:
    """Each field of `rules` the config has, against its own rule."""
    for name in rules:
        if hasattr(config, name):
            check_field(config, name, getattr(config, name))


def validate_text_config(config: Any) -> None:
    """Every field's own rule, then the rules that relate fields of the text config."""
    _check_fields(config, TEXT_RULES)
    c = config
    _require(c, c.num_attention_heads % c.o_groups == 0,
             f"num_attention_heads ({c.num_attention_heads}) must be divisible by o_groups ({c.o_groups}): the "
             "grouped output projection takes whole heads.")
    _require(c, c.qk_rope_head_dim <= c.head_dim,
             f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be at most head_dim ({c.head_dim}): RoPE rotates the "
             "last qk_rope_head_dim features of each head.")
    _require(c, c.qk_rope_head_dim <= c.index_head_dim,
             f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be at most index_head_dim ({c.index_head_dim}): index "
             "queries and keys carry the same RoPE tail.")
    _require(c, c.num_experts_per_tok <= c.n_routed_experts,
             f"num_experts_per_tok ({c.num_experts_per_tok}) must be in 1..n_routed_experts "
             f"({c.n_routed_experts}).")
    draft_experts = c.dspark_n_routed_experts or c.n_routed_experts
    draft_top_k = c.dspark_num_experts_per_tok or c.num_experts_per_tok
    _require(c, draft_top_k <= draft_experts,
             f"dspark_num_experts_per_tok ({draft_top_k}) must be at most the drafter's experts ({draft_experts}: "
             "dspark_n_routed_experts, or n_routed_experts when it is 0).")
    # token ids only the drafter or the Engram layers read: checked where those exist
    token_ids = (["dspark_noise_token_id"] if c.num_nextn_predict_layers else []) + (
        ["engram_pad_token_id"] if c.engram_layer_ids else [])
    for name in token_ids:
        value = getattr(c, name)
        _require(c, value < c.vocab_size, f"{name} ({value}) must be a token id below vocab_size ({c.vocab_size}).")
    _require(c, not c.engram_layer_ids or c.engram_compressed_vocab_size <= c.vocab_size,
             f"engram_compressed_vocab_size ({c.engram_compressed_vocab_size}) must be at most vocab_size "
             f"({c.vocab_size}): it counts the distinct ids the tokenizer's vocabulary compresses to.")
    _check_rope(c)


def validate_vision_config(config: Any) -> None:
    """Every field's own rule, then the head layout the 2D RoPE needs."""
    _check_fields(config, VISION_RULES)
    c = config
    _require(c, c.hidden_size % c.num_attention_heads == 0,
             f"hidden_size ({c.hidden_size}) must be divisible by num_attention_heads ({c.num_attention_heads}).")
    head_dim = c.hidden_size // c.num_attention_heads
    _require(c, head_dim % 4 == 0,
             f"hidden_size / num_attention_heads ({head_dim}) must be a multiple of 4: the 2D RoPE rotates half of "
             "each head's feature pairs by the patch row and half by the patch column.")


def validate_wrapper_config(config: Any) -> None:
    """weight_mode and image_token_id, and in the quantized mode the widths FP8/FP4 storage groups by 32."""
    _check_fields(config, WRAPPER_RULES)
    if config.weight_mode != "quantized" or config.text_config is None:
        return
    t = config.text_config
    widths = {
        "hidden_size": t.hidden_size, "q_lora_rank": t.q_lora_rank, "moe_intermediate_size": t.moe_intermediate_size,
        "engram_head_dim": t.engram_head_dim, "o_groups * o_lora_rank": t.o_groups * t.o_lora_rank,
    }
    for name, width in widths.items():
        _require(config, width % QUANT_GROUP == 0,
                 f"weight_mode='quantized': text_config {name} ({width}) must be a multiple of {QUANT_GROUP}, the "
                 "group size of the FP8/FP4 weight scales and the FP8 activation QDQ. Use weight_mode='bf16'.")


VALIDATORS = {TEXT_MODEL_TYPE: validate_text_config, VISION_MODEL_TYPE: validate_vision_config,
              WRAPPER_MODEL_TYPE: validate_wrapper_config}


class ValidatedConfig:
    """Mixin placed before `PreTrainedConfig`: validates the whole config once built, and each field set later."""

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        VALIDATORS[self.model_type](self)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_post_init_done"):  # set by PreTrainedConfig.__post_init__: construction is over
            check_field(self, name, value)
        super().__setattr__(name, value)
