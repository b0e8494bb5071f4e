"""Hostile conversions: a corrupted finished shard is never reused on resume, non-finite weights are refused (naming
the tensor) unless kept on request, and a refused conversion leaves nothing half-written."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conversion_scripts import convert_hub_to_native as hub_to_native_module
from conversion_scripts.convert_hub_to_native import convert_hub_to_native, main as hub_to_native_main
from conversion_scripts.convert_native_to_hub import convert_native_to_hub, main as native_to_hub_main
from conversion_scripts.streaming import MANIFEST, NonFiniteWeightError, file_digest, partial_dir
from modeling_deepseek_v41.kernels.numerics import dequantize_fp8_weight
from modeling_deepseek_v41.loading.safetensors_file import safetensors_entries
from repo_paths import FIXTURES

FIXTURE = FIXTURES / "tiny-text" / "checkpoint"
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
BF16_NAN, BF16_INF, E8M0_NAN = b"\xc0\x7f", b"\x80\x7f", b"\xff"


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def poke(folder: Path, name: str, value: bytes, element: int = 0) -> None:
    """Overwrite element `element` of tensor `name` in place (same file size, header untouched)."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    source = safetensors_entries(folder / weight_map[name])[name]
    with open(source.path, "r+b") as handle:
        handle.seek(source.offset + element * source.dtype.itemsize)
        handle.write(value)


def read_tensor(folder: Path, name: str) -> torch.Tensor:
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(folder / weight_map[name], "pt") as handle:
        return handle.get_tensor(name)


def interrupted_run(dst: Path, monkeypatch) -> Path:
    """A quantized hub -> native run that dies while writing the second shard; returns its partial folder."""
    real_copy_cast = hub_to_native_module.copy_cast

    def failing_copy_cast(source, name, dtype, chunk_bytes):
        if source.path.name == SECOND:
            raise OSError("simulated crash")
        return real_copy_cast(source, name, dtype, chunk_bytes)

    monkeypatch.setattr(hub_to_native_module, "copy_cast", failing_copy_cast)
    with pytest.raises(OSError, match="simulated crash"):
        convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    monkeypatch.setattr(hub_to_native_module, "copy_cast", real_copy_cast)
    work = partial_dir(dst)
    assert (work / FIRST).exists() and not (work / SECOND).exists() and not list(work.glob("*.tmp"))
    return work


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, bytes]:
    out = convert_hub_to_native(FIXTURE, tmp_path_factory.mktemp("clean") / "native", "quantized", progress=False)
    return folder_bytes(out)


@pytest.mark.parametrize("offset", [1 << 20, 8])  # inside the tensors, inside the JSON header
def test_flipped_byte_in_a_finished_shard_is_rewritten(tmp_path, monkeypatch, caplog, clean, offset):
    dst = tmp_path / "native"
    work = interrupted_run(dst, monkeypatch)
    shard = work / FIRST
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(bytes(data))  # same size: a size check alone would reuse it
    with caplog.at_level(logging.WARNING, logger="conversion_scripts.streaming"):
        convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    assert any(FIRST in r.getMessage() and "rewriting" in r.getMessage() for r in caplog.records), caplog.text
    assert folder_bytes(dst) == clean


def test_intact_shard_is_reused_and_output_is_identical(tmp_path, monkeypatch, caplog, clean):
    dst = tmp_path / "native"
    work = interrupted_run(dst, monkeypatch)
    first_write = (work / FIRST).stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="conversion_scripts.streaming"):
        convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    assert "rewriting" not in caplog.text
    assert (dst / FIRST).stat().st_mtime_ns == first_write
    assert folder_bytes(dst) == clean


@pytest.mark.parametrize("damage", ["unlisted", "truncated", "garbled manifest"])
def test_shards_the_manifest_does_not_vouch_for_are_rewritten(tmp_path, monkeypatch, clean, damage):
    dst = tmp_path / "native"
    work = interrupted_run(dst, monkeypatch)
    manifest = json.loads((work / MANIFEST).read_text())
    assert manifest["digests"] == {FIRST: file_digest(work / FIRST)}
    if damage == "unlisted":  # a crash between renaming the shard and recording it
        manifest["digests"] = {}
        (work / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "truncated":
        with open(work / FIRST, "r+b") as handle:
            handle.truncate((work / FIRST).stat().st_size - 100)
    else:
        (work / MANIFEST).write_bytes(b"\x00{not json")
    convert_hub_to_native(FIXTURE, dst, "quantized", progress=False)
    assert folder_bytes(dst) == clean


def hub_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "hub"
    shutil.copytree(FIXTURE, folder)
    return folder


def assert_nothing_reusable_half_written(dst: Path) -> None:
    """Every shard file in the partial folder is complete and recorded with its digest; no temporary files."""
    work = partial_dir(dst)
    if not work.exists():
        return
    assert not list(work.glob("*.tmp"))
    digests = json.loads((work / MANIFEST).read_text())["digests"]
    assert sorted(p.name for p in work.glob("*.safetensors")) == sorted(digests)
    assert all(file_digest(work / name) == digest for name, digest in digests.items())


@pytest.mark.parametrize("name, value, weight_mode, refused", [  # refused: the native (the model's) name
    ("layers.4.attn.compressor.norm.weight", BF16_NAN, "quantized", "model.layers.4.attn.compressor.norm.weight"),
    ("layers.4.attn.compressor.norm.weight", BF16_INF, "bf16", "model.layers.4.attn.compressor.norm.weight"),
    ("layers.4.attn.wkv.scale", E8M0_NAN, "quantized", "model.layers.4.attn.wkv.scale"),
    ("layers.4.attn.wkv.scale", E8M0_NAN, "bf16", "model.layers.4.attn.wkv.weight"),  # dequantized to NaN
])
def test_non_finite_hub_values_are_refused_unless_kept(tmp_path, capsys, name, value, weight_mode, refused):
    src = hub_copy(tmp_path)
    poke(src, name, value)
    dst = tmp_path / "native"
    with pytest.raises(NonFiniteWeightError, match=f"tensor {refused} has [0-9]+ non-finite") as error:
        convert_hub_to_native(src, dst, weight_mode, progress=False)
    assert "--keep-non-finite" in str(error.value)
    assert not dst.exists()
    assert_nothing_reusable_half_written(dst)  # the first shard finished, the failed second left nothing
    assert hub_to_native_main(["--src", str(src), "--dst", str(dst), "--weight-mode", weight_mode, "--quiet"]) == 5
    assert refused in capsys.readouterr().err
    assert_nothing_reusable_half_written(dst)
    out = convert_hub_to_native(src, dst, weight_mode, progress=False, keep_non_finite=True)
    kept = read_tensor(out, refused)
    assert not bool(torch.isfinite(kept.float()).all())


@pytest.fixture(scope="module")
def native_bf16(tmp_path_factory) -> Path:
    return convert_hub_to_native(FIXTURE, tmp_path_factory.mktemp("native") / "bf16", "bf16", progress=False)


@pytest.mark.parametrize("value", [BF16_NAN, BF16_INF], ids=["nan", "inf"])
def test_non_finite_bf16_weight_is_not_quantized_unless_kept(tmp_path, capsys, native_bf16, value):
    """FP8 would saturate an Inf to 448 and a NaN would become NaN codes and scales: both are refused."""
    src = tmp_path / "native"
    shutil.copytree(native_bf16, src)
    name = "layers.0.attn.wq_a.weight"
    poke(src, "model." + name, value, element=5)  # the native folder holds the model's names
    dst = tmp_path / "hub"
    with pytest.raises(NonFiniteWeightError, match=f"tensor {name} has 1 non-finite .* row 0"):
        convert_native_to_hub(src, dst, progress=False)
    assert not dst.exists()
    assert_nothing_reusable_half_written(dst)
    assert native_to_hub_main(["--src", str(src), "--dst", str(dst), "--quiet"]) == 5
    assert name in capsys.readouterr().err
    assert native_to_hub_main(["--src", str(src), "--dst", str(dst), "--quiet", "--keep-non-finite"]) == 0
    weight, scale = read_tensor(dst, name), read_tensor(dst, name.replace(".weight", ".scale"))
    assert not bool(torch.isfinite(dequantize_fp8_weight(weight, scale)[:32, :32]).all())
