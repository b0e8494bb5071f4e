"""Writing safetensors shards tensor piece by tensor piece; reading goes through the model package's one header
reader (`modeling_deepseek_v41.loading.safetensors_file`: `safetensors_entries`, `SafetensorsEntry.read_rows`).

Both sides use plain positioned file reads and writes rather than memory maps, so converting a tensor holds only the
rows being converted: peak memory is set by the chunk size, not by the size of a shard or of a tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling_deepseek_v41.loading.safetensors_file import SAFETENSORS_DTYPES

DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor an output shard will hold."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def shard_file_size(tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> int:
    """The exact size of the file `ShardWriter` writes for `tensors`."""
    header, _ = _header_bytes(tensors, metadata)
    return 8 + len(header) + sum(t.nbytes for t in tensors)


def _header_bytes(tensors: list[PlannedTensor], metadata: dict[str, str] | None) -> tuple[bytes, dict[str, int]]:
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets, position = {}, 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [position, position + tensor.nbytes]}
        offsets[tensor.name] = position
        position += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % _HEADER_ALIGN)
    return encoded, offsets


class ShardWriter:
    """Writes one safetensors file whose header is known up front; tensors arrive as row pieces in any order."""

    def __init__(self, path: str | Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.tensors = {t.name: t for t in tensors}
        header, offsets = _header_bytes(tensors, metadata)
        self.data_start = 8 + len(header)
        self.offsets = offsets
        self.written = dict.fromkeys(self.tensors, 0)
        self.handle = open(self.path, "wb")
        self.handle.write(struct.pack("<Q", len(header)) + header)
        self.handle.truncate(self.data_start + sum(t.nbytes for t in tensors))

    def write(self, name: str, row_start: int, piece: torch.Tensor) -> int:
        """Write `piece` as rows starting at `row_start` of tensor `name`; returns the bytes written."""
        planned = self.tensors[name]
        if piece.dtype != planned.dtype or tuple(piece.shape[1:]) != planned.shape[1:]:
            raise RuntimeError(f"{name}: produced {piece.dtype} {list(piece.shape)}, planned {planned.dtype} "
                               f"{list(planned.shape)}")
        data = piece.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.handle.seek(self.data_start + self.offsets[name] + row_start * planned.row_bytes)
        self.handle.write(data)
        self.written[name] += data.nbytes
        return data.nbytes

    def close(self) -> None:
        """Flush and close; every planned tensor must have been written completely."""
        self.handle.close()
        short = [n for n, t in self.tensors.items() if self.written[n] != t.nbytes]
        if short:
            raise RuntimeError(f"{self.path.name}: tensors not completely written: {short[:10]}")
