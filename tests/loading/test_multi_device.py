"""device_map placement: CPU + disk offload gives the same logits; the CSA2-aware map of the released model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling_deepseek_v41  # noqa: F401
from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from modeling_deepseek_v41.loading.device_map import (
    attention_side_devices, check_device_map, deepseek_device_map, key_bytes, module_bytes, spread_units,
)
from reference_cases import FIXTURES

CHECKPOINT = FIXTURES / "tiny-text" / "checkpoint"
GIB = 2**30


def _outputs(model) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 500, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :30], use_cache=True)
        step = model(ids[:, 30:31], cache=out.cache).logits
    return {"full": full, "decode": step}


@pytest.fixture(scope="module")
def plain_outputs():
    return _outputs(AutoModelForCausalLM.from_pretrained(CHECKPOINT))


def _block_map(model) -> dict[str, str]:
    """accelerate's usual shape: whole blocks, the first half on the CPU and the rest offloaded to disk."""
    half = len(model.model.layers) // 2
    device_map = {name: "cpu" for name in ("model.embed", "model.norm", "lm_head", "model.engram_token_map")}
    device_map.update({f"model.layers.{i}": "cpu" if i < half else "disk" for i in range(len(model.model.layers))})
    device_map.update({f"model.mtp.{i}": "disk" for i in range(len(model.model.mtp))})
    return device_map


def test_whole_blocks_on_cpu_and_disk_give_the_same_logits(plain_outputs, tmp_path):
    with torch.device("meta"):
        skeleton = DeepseekV41ForCausalLM(DeepseekV41Config.from_pretrained(CHECKPOINT))
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, device_map=_block_map(skeleton),
                                                 offload_folder=str(tmp_path))
    assert "disk" in set(model.hf_device_map.values())
    for name, value in _outputs(model).items():
        assert torch.equal(value, plain_outputs[name]), name


def test_moe_layers_offloaded_to_disk_give_the_same_logits(plain_outputs, tmp_path):
    """The CSA2-aware map with too little host memory for every MoE layer: the rest go to disk."""
    with torch.device("meta"):
        skeleton = DeepseekV41ForCausalLM(DeepseekV41Config.from_pretrained(CHECKPOINT))
    main = sum(t.nbytes for t in skeleton.state_dict().values()) - sum(
        module_bytes(dict(skeleton.named_modules())[u]) for u in spread_units(skeleton))
    device_map = deepseek_device_map(skeleton, {"cpu": (main + 3 * module_bytes(skeleton.model.layers[0].ffn)) / 0.85})
    placed = {device_map[u] for u in spread_units(skeleton)}
    assert placed == {"cpu", "disk"}
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, device_map=device_map, offload_folder=str(tmp_path))
    for name, value in _outputs(model).items():
        assert torch.equal(value, plain_outputs[name]), name


@pytest.fixture(scope="module")
def released_skeleton():
    config = DeepseekV41Config(**json.loads((FIXTURES / "spec" / "official_config.json").read_text()))
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(config)


def _bytes_per_device(model, device_map) -> dict:
    modules = dict(model.named_modules())
    totals: dict = {}
    for key, device in device_map.items():
        totals[device] = totals.get(device, 0) + key_bytes(model, modules, key)
    return totals


def test_released_model_on_8_h200(released_skeleton):
    """Every weight placed (Engram tables as parameters too), attention side on GPU 0, nothing offloaded."""
    device_map = deepseek_device_map(released_skeleton, {i: 139 * GIB for i in range(8)})
    totals = _bytes_per_device(released_skeleton, device_map)
    assert set(totals) == set(range(8))
    assert sum(totals.values()) == sum(t.nbytes for t in released_skeleton.state_dict().values())
    assert totals[0] <= 139 * GIB * 0.85 and all(v <= 139 * GIB for v in totals.values())
    assert attention_side_devices(released_skeleton, device_map) == {0}
    assert all(device_map[f"model.layers.{i}.ffn"] in range(8) for i in range(40))


def test_released_model_on_8_h100_offloads_only_the_engram_tables(released_skeleton):
    """98 GB per Engram table exceeds an 80 GB GPU: with device storage only the tables go to disk (use
    engram_storage="host"/"mmap" there); all MoE layers fit on the GPUs."""
    device_map = deepseek_device_map(released_skeleton, {i: 80 * 10**9 for i in range(8)})
    assert {u for u in spread_units(released_skeleton) if device_map[u] == "disk"} == {
        "model.layers.1.engram.embed", "model.layers.14.engram.embed"}


def test_a_map_splitting_attention_over_gpus_is_refused(released_skeleton):
    device_map = {"model.layers.0": 0, "model.layers.1": 1}
    with pytest.raises(ValueError, match="attention layers on several devices"):
        check_device_map(released_skeleton, device_map)
