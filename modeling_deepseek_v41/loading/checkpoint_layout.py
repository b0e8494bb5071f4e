"""The checkpoint's tensors: how the hub stores each one, the folder's files and index, and checking a folder
against the tensors a model holds (given as data: name -> (shape, dtype)), from the headers `safetensors_file.py`
reads.

Checking reads only the safetensors headers, so a checkpoint with missing, extra or mis-shaped tensors is
reported by name before a single weight is loaded.
"""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from pathlib import Path

import torch

from .safetensors_file import SAFETENSORS_DTYPES, parse_json_object, read_safetensors_header

# tensors the hub stores in fp32; every other fp32 parameter is stored bf16 and upcast exactly at load
_STORED_FP32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")
NOT_IN_HUB_CHECKPOINT = ("engram_token_map",)


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


def read_weight_map(index: Path) -> dict[str, str]:
    """The tensor -> shard map of a model.safetensors.index.json; a ValueError naming the file when unreadable."""
    weight_map = parse_json_object(index.read_text(errors="replace"), index, "the index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to shard files; the index is corrupted: "
                         "re-download it or delete it (the shards are then read directly).")
    return weight_map


def looks_local(path) -> bool:
    """Whether a from_pretrained argument can only be a local path (a hub repository id is "name" or "org/name")."""
    text = os.fspath(path)
    return (not isinstance(path, str) or text.startswith((os.sep, ".", "~")) or text.count("/") > 1
            or (os.altsep is not None and os.altsep in text))


def check_checkpoint_path(path) -> None:
    """A local checkpoint path must be a folder: a file, or a local-looking path that does not exist, is refused
    here rather than being tried as a hub repository id. "org/name" ids that are not local folders go to the hub."""
    if not isinstance(path, (str, os.PathLike)):
        return
    local = Path(path).expanduser()
    if local.is_file():
        raise ValueError(f"{path} is a file; from_pretrained needs the checkpoint folder that holds config.json "
                         f"and the .safetensors files (perhaps {local.parent}).")
    if looks_local(path) and not local.exists():
        raise ValueError(f"The checkpoint folder {path} does not exist; check the path (a hub repository id has "
                         "the form 'org/name').")


def check_local_paths_first(auto_class) -> None:
    """Make `auto_class.from_pretrained` (a transformers Auto model class) refuse, with check_checkpoint_path's
    message, a local-looking path that does not exist or, without a `config`, is a file: transformers resolves the
    config before any model code runs and reports such a path as an invalid hub repository id, though it can never
    load. Every other call is passed on as it is."""
    inner = auto_class.from_pretrained.__func__
    if getattr(inner, "checks_local_paths", False):
        return

    @functools.wraps(inner)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)) and looks_local(path) and kwargs.get("config") is None:
            check_checkpoint_path(path)
        return inner(cls, pretrained_model_name_or_path, *args, **kwargs)

    from_pretrained.checks_local_paths = True
    auto_class.from_pretrained = classmethod(from_pretrained)


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a folder, as its index lists them (a missing shard is an error)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_weight_map(index).values()))
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


def checkpoint_has_prefix(folder: str | os.PathLike, prefix: str | tuple[str, ...]) -> bool:
    """Whether any tensor of a local checkpoint folder starts with `prefix` (or one of several; from the index or
    the headers)."""
    index = Path(folder) / "model.safetensors.index.json"
    if index.exists():
        return any(name.startswith(prefix) for name in read_weight_map(index))
    return any(name.startswith(prefix) for path in checkpoint_files(folder) for name in read_safetensors_header(path))


def saved_with_module_names(folder: str | os.PathLike) -> bool:
    """Whether a local folder holds the module names (what save_pretrained writes by default: a `model.` prefix and
    `lm_head.`) rather than the hub's."""
    return checkpoint_has_prefix(folder, ("model.", "lm_head."))


def holds_drafter(folder: str | os.PathLike) -> bool:
    """Whether a local folder holds DSpark drafter weights, under the hub's names or the module names."""
    return checkpoint_has_prefix(folder, ("mtp.", "model.mtp."))
