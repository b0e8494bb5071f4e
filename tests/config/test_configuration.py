"""Configurations: the hub files load unchanged, round-trip, and inconsistent schedules fail with clear errors."""

from __future__ import annotations

import json

import pytest

from modeling_deepseek_v41 import CSA2Role, DeepseekV41Config, DeepseekV41TextConfig, LayerPlan
from reference_cases import FIXTURES, model_case_dirs

OFFICIAL = FIXTURES / "spec" / "official_config.json"


def tiny_text(**overrides) -> dict:
    config = json.loads((FIXTURES / "tiny-text" / "checkpoint" / "config.json").read_text())["text_config"]
    config.update(overrides)
    return config


def test_official_config_loads_and_round_trips(tmp_path):
    raw = json.loads(OFFICIAL.read_text())
    config = DeepseekV41Config(**raw)
    assert config.text_config.hidden_size == 5120 and config.vision_config.num_hidden_layers == 32
    assert config.checkpoint_quantization == raw["quantization_config"] and config.weight_mode == "quantized"
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"] == raw["quantization_config"]
    assert saved["image_token_id"] == raw["image_token_id"]
    reloaded = DeepseekV41Config.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()
    for key, value in raw["text_config"].items():
        if key != "rope_scaling":
            assert getattr(reloaded.text_config, key) == value, key
    for key, value in raw["text_config"]["rope_scaling"].items():
        assert reloaded.text_config.rope_scaling[key] == value


@pytest.mark.parametrize("case", model_case_dirs(), ids=lambda c: c.name)
def test_fixture_configs_load(case, tmp_path):
    raw = json.loads((case / "checkpoint" / "config.json").read_text())
    config = DeepseekV41Config(**raw)
    config.save_pretrained(tmp_path)
    assert DeepseekV41Config.from_pretrained(tmp_path).to_dict() == config.to_dict()


def test_released_layer_plan_roles():
    plan = LayerPlan.from_config(DeepseekV41TextConfig())
    roles = {spec.layer_id: spec.role for spec in plan.layers}
    assert [roles[i] for i in (0, 1)] == ["window", "window"]
    assert all(roles[i] == "full" for i in (2, 8, 14, 20))
    assert all(roles[i] == "reindex" for i in (24, 28, 32, 36))
    assert all(roles[i] == "reuse" for i in (3, 7, 9, 19, 21, 23, 25, 39))
    assert plan.layers[19].pool_source == 14 and plan.layers[23].pool_source == 20
    assert plan.layers[27].topk_source == 24 and plan.layers[22].topk_source == 20
    assert plan.layers[20].is_candidate_source and plan.layers[24].uses_candidates
    assert not plan.layers[20].uses_candidates and not plan.layers[14].uses_candidates
    assert [s.layer_id for s in plan.layers if s.engram_slot is not None] == [1, 14]
    assert [s.layer_id for s in plan.layers if s.is_dspark_tap] == [37, 38, 39]
    assert plan.layers[1].rope_theta == 10000 and not plan.layers[1].use_yarn
    assert plan.layers[2].rope_theta == 160000 and plan.layers[2].use_yarn
    assert len(plan.dspark_layers) == 3 and all(s.ratio == 0 for s in plan.dspark_layers)


def test_the_csa2_roles_are_named_on_the_layer_spec():
    plan = LayerPlan.from_config(DeepseekV41TextConfig())
    layers = plan.layers
    assert layers[2].role is CSA2Role.FULL and layers[24].role == "reindex"  # the enum equals the plain names
    assert [i for i, s in enumerate(layers) if s.is_full] == [2, 8, 14, 20]
    assert [i for i, s in enumerate(layers) if s.is_reindex] == [24, 28, 32, 36]
    assert all(s.is_reuse for s in layers[21:24]) and not any(s.reads_pool for s in layers[:2] + plan.dspark_layers)
    assert all(s.reads_pool == (s.ratio > 0) for s in layers)
    assert all((s.is_full or s.is_reindex) == s.is_index_source and s.is_full == s.owns_pool for s in layers)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0]}, "compress_ratios has 9 entries but num_hidden_layers"),
        ({"kv_source_layer_ids": [4], "index_source_layer_ids": [4, 6]},
         "layer 1 (ratio 2) reads a compressed pool, but no KV-source layer"),
        ({"compress_ratios": [0, 2, 2, 1, 1, 1, 1, 1, 0, 0]}, "layer 3 has ratio 1 but the pool it reads"),
        ({"dspark_target_layer_ids": [5, 6, 8]}, "DSpark target layer 8 is outside the backbone"),
        ({"engram_layer_ids": [1, 3, 5]}, "engram_num_embeddings has 2 entries but engram_layer_ids has 3"),
        ({"index_source_layer_ids": [4, 6]}, "layer 1 is a KV source but not an index source"),
        ({"candidate_source_layer_id": 5}, "candidate source layer 5 must be an index source"),
        ({"compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 1]}, "DSpark block 1 (compress_ratios[9])"),
        ({"kv_source_layer_ids": [0, 1, 4], "index_source_layer_ids": [0, 1, 4, 6]},
         "layer 0 is listed as a KV/index source but has compress ratio 0"),
        ({"kv_source_layer_ids": [4, 1], "index_source_layer_ids": [1, 4, 6]}, "strictly increasing"),
        ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids is empty"),
    ],
)
def test_inconsistent_schedules_are_rejected(overrides, message):
    with pytest.raises(ValueError, match="Inconsistent DeepSeek-V4.1 layer schedule") as error:
        DeepseekV41TextConfig(**tiny_text(**overrides))
    assert message in str(error.value)


def test_reindex_reading_another_pool_is_rejected():
    overrides = {
        "num_hidden_layers": 8,
        "compress_ratios": [0, 1, 1, 1, 1, 1, 1, 1, 0, 0],
        "kv_source_layer_ids": [1, 4], "index_source_layer_ids": [1, 4, 6], "candidate_source_layer_id": 1,
    }
    with pytest.raises(ValueError, match="index source 4 comes after candidate source 1 but reads layer 4's pool"):
        DeepseekV41TextConfig(**tiny_text(**overrides))


def test_weight_mode_errors():
    with pytest.raises(ValueError, match="weight_mode must be one of"):
        DeepseekV41Config(text_config=tiny_text(), weight_mode="int4")
    with pytest.raises(ValueError, match="needs a checkpoint that stores quantized weights"):
        DeepseekV41Config(text_config=tiny_text(), weight_mode="quantized")
