"""The released configuration on the meta device: tensor inventory and parameter counts per component."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from modeling_deepseek_v41.loading.checkpoint_layout import pattern_of
from modeling_deepseek_v41.loading.parameter_count import count_parameters
from modeling_deepseek_v41.model.checkpoint import expected_tensors
from reference_cases import FIXTURES


@pytest.fixture(scope="module")
def released_config():
    return DeepseekV41Config(**json.loads((FIXTURES / "spec" / "official_config.json").read_text()))


@pytest.fixture(scope="module")
def released_model(released_config):
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(released_config)


def test_released_parameter_counts(released_model):
    """Logical weights (packed FP4 counts twice, scales not at all), in billions, against the seed's table."""
    counts = {k: v / 1e9 for k, v in count_parameters(released_model).items()}
    assert counts["routed_experts"] == pytest.approx(543.6, abs=0.05)
    assert counts["attention"] == pytest.approx(5.1, abs=0.05)
    assert counts["embed_and_head"] == pytest.approx(1.3, abs=0.05)
    assert counts["backbone"] == pytest.approx(552, abs=0.5)
    assert counts["engram_tables"] == pytest.approx(196.6, abs=0.05)
    assert counts["dspark"] == pytest.approx(14, abs=0.5)
    assert counts["vision_tower"] == pytest.approx(0.4, abs=0.05)


def test_released_checkpoint_inventory(released_config):
    expected = expected_tensors(released_config)
    assert len(expected) == 96085
    patterns = {}
    for name in expected:
        patterns[pattern_of(name)] = patterns.get(pattern_of(name), 0) + 1
    assert patterns["layers.{N}.ffn.experts.{N}.w1.weight"] == 15360
    assert patterns["mtp.{N}.ffn.experts.{N}.w2.scale"] == 384
    assert expected["layers.3.ffn.experts.7.w1.weight"] == ((2304, 2560), torch.int8)
    assert expected["layers.3.attn.wq_a.scale"] == ((40, 160), torch.float8_e8m0fnu)
    assert expected["layers.20.attn.compressor.wkv.weight"] == ((512, 5120), torch.bfloat16)
    assert expected["layers.2.attn.compressor.wgate.weight"] == ((512, 5120), torch.bfloat16)
    assert expected["head.weight"] == ((129280, 5120), torch.bfloat16)
    assert expected["layers.0.hc_attn_fn"] == ((24, 20480), torch.float32)
    assert expected["layers.14.engram.embed.weight"] == ((384016682, 256), torch.float8_e4m3fn)
    assert "engram_token_map" not in expected


def test_released_held_dtypes(released_model):
    assert released_model.lm_head.weight.dtype == torch.float32
    assert released_model.model.layers[2].attn.compressor.wkv.weight.dtype == torch.float32
    assert released_model.model.layers[20].attn.compressor.wkv.weight.dtype == torch.bfloat16
    assert released_model.model.layers[5].attn.wo_a.weight.dtype == torch.float8_e4m3fn
    assert released_model.model.vision.norm.weight.dtype == torch.float32
