"""Hub <-> native conversion: bit-exact round trips, equal logits, source validation, resume and the CLIs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import modeling_deepseek_v41  # noqa: F401  (registers the Auto classes)
from conversion_scripts import convert_hub_to_native as hub_to_native_module
from conversion_scripts.convert_hub_to_native import convert_hub_to_native, main as hub_to_native_main
from conversion_scripts.convert_native_to_hub import convert_native_to_hub, main as native_to_hub_main
from conversion_scripts.layout import CheckpointError, quantized_weight_kinds, scale_name
from conversion_scripts.streaming import partial_dir
from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight, dequantize_fp8_weight, fp8_dequantize_rows
from modeling_deepseek_v41.model.checkpoint import validate_checkpoint_folder
from repo_paths import FIXTURES, ROOT

FIXTURE = FIXTURES / "tiny-text" / "checkpoint"


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        with safe_open(folder / filename, "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def dequantized(name: str, kind: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    weight, scale = tensors[name], tensors[scale_name(name)]
    if kind == "fp8_tile":
        return dequantize_fp8_weight(weight, scale)
    if kind == "fp4":
        return dequantize_fp4_weight(weight, scale)
    return fp8_dequantize_rows(weight, scale, torch.float32)


def prompt_ids() -> torch.Tensor:
    return torch.tensor([[0, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 46, 300, 301, 17, 18, 19, 20, 21]])


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    out = {
        "native_bf16": convert_hub_to_native(FIXTURE, root / "native_bf16", "bf16", progress=False),
        "native_quantized": convert_hub_to_native(FIXTURE, root / "native_quantized", "quantized", progress=False),
    }
    out["hub_from_bf16"] = convert_native_to_hub(out["native_bf16"], root / "hub_from_bf16", progress=False)
    out["hub_from_quantized"] = convert_native_to_hub(out["native_quantized"], root / "hub_from_quantized",
                                                      progress=False)
    return out


@pytest.mark.parametrize("which", ["hub_from_quantized", "hub_from_bf16"])
def test_round_trip_is_bit_identical(converted, which):
    original, back = read_folder(FIXTURE), read_folder(converted[which])
    assert set(original) == set(back)
    different = [name for name in original if not same_bytes(original[name], back[name])]
    assert different == []
    original_map = json.loads((FIXTURE / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((converted[which] / "model.safetensors.index.json").read_text())["weight_map"] == original_map
    validate_checkpoint_folder(converted[which], modeling_deepseek_v41.DeepseekV41Config.from_pretrained(FIXTURE))


def test_round_trip_without_hub_scales_is_value_exact(tmp_path):
    """Without the kept scales, requantizing re-derives every scale from its tile's amax: values come back exactly,
    bytes only where the stored scale is the one amax gives (the fixture has tiles where it is not)."""
    native = convert_hub_to_native(FIXTURE, tmp_path / "native", "bf16", keep_hub_scales=False, progress=False)
    assert not list(native.glob("hub_scales*"))
    back = read_folder(convert_native_to_hub(native, tmp_path / "hub", progress=False))
    original = read_folder(FIXTURE)
    kinds = quantized_weight_kinds(modeling_deepseek_v41.DeepseekV41Config.from_pretrained(FIXTURE))
    scales = {scale_name(n) for n in kinds}
    for name in original:
        if name in kinds:
            assert torch.equal(dequantized(name, kinds[name], original), dequantized(name, kinds[name], back)), name
        elif name not in scales:
            assert same_bytes(original[name], back[name]), name


def test_native_layout_matches_save_pretrained(converted):
    from transformers import AutoModelForCausalLM

    for which, mode in (("native_bf16", "bf16"), ("native_quantized", "quantized")):
        folder = converted[which]
        config = json.loads((folder / "config.json").read_text())
        assert config["weight_mode"] == mode
        assert ("quantization_config" in config) == (mode == "quantized")
        assert (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists()
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        stored = read_folder(folder)
        state = model.state_dict()  # save_pretrained writes the state dict's names
        assert set(stored) == set(state)
        assert all(same_bytes(stored[n], state[n]) for n in stored)


@pytest.mark.parametrize("which, mode", [("native_quantized", "quantized"), ("native_bf16", "bf16")])
def test_native_gives_the_hub_logits(converted, which, mode):
    from transformers import AutoModelForCausalLM

    hub = AutoModelForCausalLM.from_pretrained(FIXTURE, weight_mode=mode)
    native = AutoModelForCausalLM.from_pretrained(converted[which])
    assert native.config.weight_mode == mode
    assert torch.equal(native.model.engram_token_map, hub.model.engram_token_map)
    with torch.no_grad():
        assert torch.equal(native(prompt_ids()).logits, hub(prompt_ids()).logits)


def broken_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(FIXTURE, folder)
    return folder


def assert_nothing_written(dst: Path) -> None:
    assert not dst.exists() and not partial_dir(dst).exists()


@pytest.mark.parametrize("damage, expected", [
    ("truncate", "model-00002-of-00002.safetensors is truncated"),
    ("remove", "model-00002-of-00002.safetensors"),
    ("reshape", "layers.0.attn.wq_a.weight: shape"),
])
def test_invalid_source_stops_before_writing(tmp_path, damage, expected):
    src = broken_copy(tmp_path)
    shard = src / "model-00002-of-00002.safetensors"
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "remove":
        shard.unlink()
    else:
        first = src / "model-00001-of-00002.safetensors"
        tensors = load_file(first)
        tensors["layers.0.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"][:, :64].contiguous()
        save_file(tensors, first, metadata={"format": "pt"})
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=expected):
        convert_hub_to_native(src, dst, progress=False)
    assert_nothing_written(dst)
    assert hub_to_native_main(["--src", str(src), "--dst", str(dst), "--quiet"]) == 3
    assert_nothing_written(dst)


def test_invalid_native_source_stops_before_writing(tmp_path, converted):
    src = tmp_path / "native"
    shutil.copytree(converted["native_bf16"], src)
    (src / "model-00001-of-00002.safetensors").unlink()
    dst = tmp_path / "hub"
    assert native_to_hub_main(["--src", str(src), "--dst", str(dst), "--quiet"]) == 3
    assert_nothing_written(dst)


def test_interrupted_run_resumes(tmp_path, monkeypatch):
    dst = tmp_path / "native"
    real_copy_cast = hub_to_native_module.copy_cast

    def failing_copy_cast(source, name, dtype, chunk_bytes):
        if source.path.name.startswith("model-00002"):
            raise OSError("simulated disk failure")
        return real_copy_cast(source, name, dtype, chunk_bytes)

    monkeypatch.setattr(hub_to_native_module, "copy_cast", failing_copy_cast)
    with pytest.raises(OSError, match="simulated"):
        convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    assert not dst.exists()
    finished = partial_dir(dst) / "model-00001-of-00002.safetensors"
    first_write = finished.stat().st_mtime_ns
    monkeypatch.setattr(hub_to_native_module, "copy_cast", real_copy_cast)
    convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    assert not partial_dir(dst).exists()
    assert (dst / "model-00001-of-00002.safetensors").stat().st_mtime_ns == first_write  # not rewritten
    reference = tmp_path / "reference"
    convert_hub_to_native(FIXTURE, reference, "quantized", progress=False)
    a, b = read_folder(dst), read_folder(reference)
    assert set(a) == set(b) and all(same_bytes(a[n], b[n]) for n in a)


def test_existing_destination_is_refused(tmp_path):
    dst = tmp_path / "exists"
    dst.mkdir()
    assert hub_to_native_main(["--src", str(FIXTURE), "--dst", str(dst), "--quiet"]) == 4


@pytest.mark.parametrize("main", [hub_to_native_main, native_to_hub_main])
def test_cli_help(main, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--src" in capsys.readouterr().out


def test_cli_module_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "conversion_scripts.convert_hub_to_native", "--src", str(FIXTURE), "--dst",
         str(tmp_path / "out"), "--weight-mode", "quantized", "--quiet"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_random_vision_checkpoint_round_trips_with_resharding(tmp_path):
    """FP4 groups whose scale is not the amax-derived one (random codes) and the vision tensors come back exactly,
    also when the native copy is re-sharded."""
    from conversion_scripts.make_random_checkpoint import make_random_checkpoint

    hub = make_random_checkpoint(tmp_path / "hub", vision=True, seed=5)
    native = convert_hub_to_native(hub, tmp_path / "native", "bf16", max_shard_size="1MB", progress=False)
    assert len(set(json.loads((native / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    back = convert_native_to_hub(native, tmp_path / "back", progress=False)
    original, returned = read_folder(hub), read_folder(back)
    assert set(original) == set(returned)
    assert [n for n in original if not same_bytes(original[n], returned[n])] == []


def test_changed_weights_get_fresh_scales_only_where_changed(tmp_path):
    """After fine-tuning, tiles the kept hub scales no longer represent are requantized from their amax; the other
    tiles keep the hub's bytes."""
    from modeling_deepseek_v41.kernels.numerics import quantize_fp8_weight

    native = convert_hub_to_native(FIXTURE, tmp_path / "native", "bf16", progress=False)
    name = "layers.0.attn.wq_a.weight"
    stored = "model." + name  # the native layout's (the model's) name
    shard = native / json.loads((native / "model.safetensors.index.json").read_text())["weight_map"][stored]
    tensors = load_file(shard)
    changed = tensors[stored].clone()
    changed[:32, :32] = (changed[:32, :32].float() * 1.37 + 0.001).to(torch.bfloat16)
    tensors[stored] = changed
    save_file(tensors, shard, metadata={"format": "pt"})
    back = read_folder(convert_native_to_hub(native, tmp_path / "hub", progress=False))
    original = read_folder(FIXTURE)
    weight, scale = back[name], back[scale_name(name)]
    fresh_weight, fresh_scale = quantize_fp8_weight(changed[:32, :32])
    assert same_bytes(weight[:32, :32], fresh_weight) and same_bytes(scale[:1, :1], fresh_scale)
    assert same_bytes(weight[32:], original[name][32:]) and same_bytes(weight[:, 32:], original[name][:, 32:])
    assert same_bytes(scale[1:], original[scale_name(name)][1:])
    assert same_bytes(scale[:, 1:], original[scale_name(name)][:, 1:])
