"""Hostile configs: impossible values are refused when the config is built (or a field is set), naming the field."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from conversion_scripts.presets import PRESETS
from model_factory import OTHER_SCHEDULES, RELEASED_WIDTHS, schedule_config
from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41TextConfig, DeepseekV41VisionConfig
from reference_cases import FIXTURES

TINY = FIXTURES / "tiny-text" / "checkpoint"
VISION = FIXTURES / "tiny-vision" / "checkpoint"


def tiny_text(**overrides) -> dict:
    config = json.loads((TINY / "config.json").read_text())["text_config"]
    config.update(overrides)
    return config


def tiny_vision(**overrides) -> dict:
    config = json.loads((VISION / "config.json").read_text())["vision_config"]
    config.update(overrides)
    return config


# issue 19's list, plus the neighbours of each rule; (overrides, field the message must name)
TEXT_CASES = [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": -16}, "sliding_window"),
    ({"index_topk": 0}, "index_topk"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # the fixture has 8 routed experts
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"dspark_block_size": -1}, "dspark_block_size"),
    ({"hidden_size": -128}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"head_dim": -64}, "head_dim"),
    ({"head_dim": 48}, "head_dim"),  # the window KV is FP8 in groups of 32
    ({"hc_mult": 0}, "hc_mult"),
    ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
    ({"candidate_block_size": 0}, "candidate_block_size"),
    ({"qk_rope_head_dim": 31}, "qk_rope_head_dim"),
    ({"qk_rope_head_dim": 96}, "qk_rope_head_dim"),  # longer than head_dim 64
    ({"engram_compressed_vocab_size": 0}, "engram_compressed_vocab_size"),
    ({"engram_compressed_vocab_size": 513}, "engram_compressed_vocab_size"),  # more than vocab_size 512
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
    ({"o_lora_rank": -32}, "o_lora_rank"),
    ({"o_groups": 0}, "o_groups"),
    ({"o_groups": 3}, "o_groups"),  # 4 heads are not divisible into 3 groups
    ({"index_head_dim": 0}, "index_head_dim"),
    ({"index_n_heads": 0}, "index_n_heads"),
    ({"candidate_topk_blocks": 0}, "candidate_topk_blocks"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"n_routed_experts": 0}, "n_routed_experts"),
    ({"scoring_func": "sqrt_softplus"}, "scoring_func"),
    ({"prefill_mode": "bounded-replay"}, "prefill_mode"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"engram_storage": "ssd"}, "engram_storage"),
    ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"engram_n_heads": 0}, "engram_n_heads"),
    ({"engram_head_dim": 0}, "engram_head_dim"),
    ({"engram_vocab_size": -1}, "engram_vocab_size"),
    ({"dspark_noise_token_id": 512}, "dspark_noise_token_id"),
    ({"engram_pad_token_id": -1}, "engram_pad_token_id"),
    ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),  # the drafter has 4 experts
    ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ({"hidden_size": 128.0}, "hidden_size"),  # a size must be an integer
    ({"sliding_window": True}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0, "beta_fast": 32, "beta_slow": 1,
                       "original_max_position_embeddings": 4096}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_type"),  # would be ignored: refused instead
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type"),
]


@pytest.mark.parametrize("overrides, field", TEXT_CASES, ids=lambda case: json.dumps(case, default=str)[:60])
def test_impossible_text_values_are_refused(overrides, field):
    with pytest.raises(ValueError) as error:
        DeepseekV41TextConfig(**tiny_text(**overrides))
    assert field in str(error.value), str(error.value)


@pytest.mark.parametrize("overrides, field", [
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 3}, "num_attention_heads"),  # 64 is not divisible by 3
    ({"num_attention_heads": 32}, "num_attention_heads"),  # 2 features per head: the 2D RoPE needs a multiple of 4
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"patch_size": 0}, "patch_size"),
    ({"downsample_ratio": 0}, "downsample_ratio"),
    ({"max_image_tokens": 3}, "max_image_tokens"),
    ({"min_pixels": -1}, "min_pixels"),
    ({"max_wh_ratio": 0.0}, "max_wh_ratio"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_impossible_vision_values_are_refused(overrides, field):
    with pytest.raises(ValueError) as error:
        DeepseekV41VisionConfig(**tiny_vision(**overrides))
    assert field in str(error.value), str(error.value)
    raw = json.loads((VISION / "config.json").read_text())
    raw["vision_config"] = tiny_vision(**overrides)
    with pytest.raises(ValueError, match=field):  # also as a dict inside the multimodal config
        DeepseekV41Config(**raw)


def test_nested_text_dict_is_validated():
    raw = json.loads((TINY / "config.json").read_text())
    raw["text_config"]["index_topk"] = 0
    with pytest.raises(ValueError, match="index_topk must be a positive integer, got 0"):
        DeepseekV41Config(**raw)


def test_weight_mode_typo_is_refused_everywhere(tmp_path):
    """'bf-16' is refused when the config is built, however it is built, so it can never be saved."""
    raw = json.loads((TINY / "config.json").read_text())
    with pytest.raises(ValueError, match=r"weight_mode must be one of \('quantized', 'bf16'\), got 'bf-16'"):
        DeepseekV41Config(**{**raw, "weight_mode": "bf-16"})
    with pytest.raises(ValueError, match="weight_mode.*'bf-16'"):
        DeepseekV41Config.from_pretrained(TINY, weight_mode="bf-16")
    with pytest.raises(ValueError, match="weight_mode.*'bf-16'"):
        AutoConfig.from_pretrained(TINY, weight_mode="bf-16")
    with pytest.raises(ValueError, match="weight_mode.*'bf-16'"):
        AutoModelForCausalLM.from_pretrained(TINY, weight_mode="bf-16")
    config = DeepseekV41Config.from_pretrained(TINY)
    with pytest.raises(ValueError, match="weight_mode.*'bf-16'"):
        config.weight_mode = "bf-16"
    assert config.weight_mode == "quantized"  # the refused value was never stored
    config.save_pretrained(tmp_path)
    assert DeepseekV41Config.from_pretrained(tmp_path).weight_mode == "quantized"


def test_fields_set_after_construction_are_checked():
    config = DeepseekV41Config.from_pretrained(TINY)
    for field, value in (("sliding_window", 0), ("hc_mult", 0), ("scoring_func", "sofmax")):
        with pytest.raises(ValueError, match=field):
            setattr(config.text_config, field, value)
    with pytest.raises(ValueError, match="image_token_id"):
        config.image_token_id = -1
    vision = DeepseekV41Config.from_pretrained(VISION).vision_config
    with pytest.raises(ValueError, match="patch_size"):
        vision.patch_size = 0
    config.text_config.sliding_window = 32  # a valid value is taken
    assert config.text_config.sliding_window == 32


def test_quantized_weight_mode_needs_widths_in_groups_of_32():
    raw = json.loads((TINY / "config.json").read_text())
    raw["text_config"]["q_lora_rank"] = 48
    with pytest.raises(ValueError, match=r"q_lora_rank \(48\) must be a multiple of 32"):
        DeepseekV41Config(**raw)
    raw.pop("quantization_config")  # the bf16 weight mode stores no FP8 groups of those widths
    assert DeepseekV41Config(**raw).text_config.q_lora_rank == 48


def test_every_shipped_and_test_config_still_validates(tmp_path):
    folders = [TINY, VISION, FIXTURES.parent.parent / "examples" / "default-checkpoint"]
    raws = [json.loads((folder / "config.json").read_text()) for folder in folders if folder.exists()]
    raws.append(json.loads((FIXTURES / "spec" / "official_config.json").read_text()))
    for raw in raws:
        config = DeepseekV41Config(**raw)
        config.save_pretrained(tmp_path)
        assert DeepseekV41Config.from_pretrained(tmp_path).to_dict() == config.to_dict()
        assert DeepseekV41Config.from_dict(config.to_dict()).to_dict() == config.to_dict()
    for _, vision in PRESETS.values():  # the text presets are completed from a tokenizer: test_random_checkpoint
        DeepseekV41VisionConfig(**vision)
    for schedule in (*OTHER_SCHEDULES.values(), RELEASED_WIDTHS):
        schedule_config(schedule)
    DeepseekV41Config()  # the defaults are the released model
