"""The checkpoint's tensors: how the hub stores each one, reading safetensors headers, and checking a folder
against the tensors a model holds (given as data: name -> (shape, dtype)).

Checking reads only the safetensors headers, so a checkpoint with missing, extra or mis-shaped tensors is
reported by name before a single weight is loaded.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from pathlib import Path

import torch

# tensors the hub stores in fp32; every other fp32 parameter is stored bf16 and upcast exactly at load
_STORED_FP32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")
NOT_IN_HUB_CHECKPOINT = ("engram_token_map",)

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8,
    "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
}


def hub_storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the hub checkpoint stores a parameter in, given the dtype the model holds it in."""
    if dtype == torch.float32 and not _STORED_FP32.search(name):
        return torch.bfloat16
    return dtype


def stored_tensors(held: dict[str, tuple[tuple[int, ...], torch.dtype]], hub_layout: bool = True
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, stored dtype) from the tensors a model holds (name -> (shape, dtype)): in the hub layout
    without what the hub does not store and with the hub's storage dtypes, else as held."""
    expected = {}
    for name, (shape, dtype) in held.items():
        if hub_layout and name in NOT_IN_HUB_CHECKPOINT:
            continue
        expected[name] = (shape, hub_storage_dtype(name, dtype) if hub_layout else dtype)
    return expected


def safetensors_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(header length, header) of one safetensors file, `__metadata__` removed; a clear error if truncated."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} is truncated: it is too short to hold a safetensors header.")
        header_len = struct.unpack("<Q", prefix)[0]
        if 8 + header_len > size:
            raise ValueError(f"{path.name} is truncated: its header says {header_len} bytes, the file is shorter.")
        header = json.loads(handle.read(header_len))
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + end > size:
        raise ValueError(
            f"{path.name} is truncated: its tensors need {8 + header_len + end} bytes but the file has {size}."
        )
    return header_len, header


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string) from one file's header; a clear error if it is truncated."""
    _, header = safetensors_header(path)
    return {name: (tuple(info["shape"]), info["dtype"]) for name, info in header.items()}


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a folder, as its index lists them (a missing shard is an error)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise ValueError(f"Checkpoint shard(s) listed in {index.name} are missing from {folder}: {missing}")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def pattern_of(name: str) -> str:
    """A tensor name with its layer, block and expert numbers replaced by placeholders (for counting)."""
    return re.sub(r"\.\d+\.", ".{N}.", re.sub(r"\.\d+\.", ".{N}.", name))


def describe_mismatch(expected: dict, found: dict[str, tuple[tuple[int, ...], str]], limit: int = 20) -> list[str]:
    """Human-readable problems: missing, unexpected and mis-shaped (or mis-typed) tensors, by name."""
    problems = []
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    wrong = []
    for name, (shape, dtype_str) in found.items():
        if name not in expected:
            continue
        want_shape, want_dtype = expected[name]
        have_dtype = SAFETENSORS_DTYPES.get(dtype_str)
        if shape != want_shape:
            wrong.append(f"{name}: shape {list(shape)}, expected {list(want_shape)}")
        elif have_dtype != want_dtype and not _loss_free_cast(have_dtype, want_dtype):
            wrong.append(f"{name}: dtype {dtype_str}, expected {want_dtype}")
    for title, names in (("missing", missing), ("unexpected", extra), ("mis-shaped", wrong)):
        if names:
            shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
            problems.append(f"{len(names)} {title} tensor(s): {shown}")
    return problems


_DENSE_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _loss_free_cast(have: torch.dtype | None, want: torch.dtype) -> bool:
    """Dense floating-point tensors are cast to the parameter's dtype on load; quantized bytes, scales and integer
    tensors must be stored exactly as the model holds them."""
    return have in _DENSE_FLOATS and want in _DENSE_FLOATS


def check_checkpoint_folder(folder: str | os.PathLike, held: dict[str, tuple[tuple[int, ...], torch.dtype]],
                            hub_layout: bool | None = None) -> dict:
    """Check a local checkpoint folder against the tensors a model holds (name -> (shape, dtype)) from the
    folder's headers alone; raise naming every problem. The hub layout is detected when not given.

    Returns the per-pattern tensor counts found (useful to compare with the released checkpoint's)."""
    files = checkpoint_files(folder)
    if not files:
        raise ValueError(f"No .safetensors files in {folder}.")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        found.update(read_safetensors_header(path))
    if hub_layout is None:
        hub_layout = "engram_token_map" not in found
    expected = stored_tensors(held, hub_layout=hub_layout)
    if not hub_layout:
        expected.pop("engram_token_map", None)
        found.pop("engram_token_map", None)
    problems = describe_mismatch(expected, found)
    if problems:
        raise ValueError(f"The checkpoint in {folder} does not match its config:\n- " + "\n- ".join(problems))
    return dict(Counter(pattern_of(n) for n in found))


def checkpoint_has_prefix(folder: str | os.PathLike, prefix: str) -> bool:
    """Whether any tensor of a local checkpoint folder starts with `prefix` (from the index or the headers)."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.exists():
        return any(name.startswith(prefix) for name in json.loads(index.read_text())["weight_map"])
    return any(name.startswith(prefix) for path in checkpoint_files(folder) for name in read_safetensors_header(path))
