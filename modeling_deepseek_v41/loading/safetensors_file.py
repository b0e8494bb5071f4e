"""The one safetensors header reader: a file's header (checked against truncation and corruption, with errors that
name the file), and where each tensor's bytes sit, read with positioned reads. The checkpoint checks, the Engram
tables kept off the device and the conversion scripts all read files through it."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8,
    "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool,
}


def parse_json_object(text: bytes | str, path: Path, what: str) -> dict:
    """A JSON object read from `path`; a ValueError naming the file when it is not one."""
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: {what} is not valid JSON ({error}); the file is corrupted: re-download or "
                         "re-convert the checkpoint.") from error
    if not isinstance(parsed, dict):
        raise ValueError(f"{path}: {what} is JSON but not an object; the file is corrupted: re-download or "
                         "re-convert the checkpoint.")
    return parsed


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
        header = parse_json_object(handle.read(header_len), path, "its safetensors header")
    header.pop("__metadata__", None)
    if not all(isinstance(info, dict) and len(info.get("data_offsets", ())) == 2 for info in header.values()):
        raise ValueError(f"{path} has a malformed safetensors header (a tensor entry without data_offsets); the "
                         "file is corrupted: re-download or re-convert it.")
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


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor's bytes sit inside a safetensors file."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def read_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) along the first dim (the whole tensor by default), as a fresh tensor. A positioned
        read rather than a memory map: reading a tensor in pieces holds only the piece."""
        stop = self.rows if stop is None else stop
        count = (stop - start) * self.row_bytes
        shape = ((stop - start),) + self.shape[1:] if self.shape else ()
        if count == 0:
            return torch.empty(shape, dtype=self.dtype)
        buffer = bytearray(count)
        with open(self.path, "rb") as handle:
            handle.seek(self.offset + start * self.row_bytes)
            if handle.readinto(buffer) != count:
                raise ValueError(f"{self.path.name} is truncated: a tensor's bytes end past the end of the file.")
        return torch.frombuffer(buffer, dtype=torch.uint8).view(self.dtype).reshape(shape)


def safetensors_entries(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, SafetensorsEntry]:
    """name -> SafetensorsEntry for the named tensors of one safetensors file (every tensor by default), from its
    header alone; a tensor that is absent or of a dtype torch cannot hold here is an error naming it."""
    path = Path(path)
    header_len, header = safetensors_header(path)
    entries = {}
    for name in header if names is None else names:
        if name not in header:
            raise KeyError(f"{path.name} holds no tensor named {name!r}.")
        info = header[name]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, which cannot be read here "
                             f"(readable: {', '.join(SAFETENSORS_DTYPES)}).")
        start, end = info["data_offsets"]
        entries[name] = SafetensorsEntry(path, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                         8 + header_len + start, end - start)
    return entries
