"""Engram tables kept off the compute device: in host memory (pinned when CUDA is present) or memory-mapped from
the checkpoint's safetensors file.

Only the rows a forward looks up move to the compute device. Their ids are known as soon as the token ids are
(`engram_hashing.py`), so the model's forward starts every table's gather and host-to-device copy before the first
layer runs (`DeepseekV41EngramHasher.prefetch`); the Engram layer then picks up the finished rows.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..layers.engram import PendingRows
from .checkpoint_layout import checkpoint_files, read_weight_map
from .safetensors_file import SafetensorsEntry, read_safetensors_header, safetensors_entries

HOST_COPY_CHUNK = 1 << 26  # bytes copied per step from the file into host memory (bounds the transient pages)


def mapped_tensor(entry: SafetensorsEntry) -> torch.Tensor:
    """A CPU tensor whose storage is the file's bytes: a private (copy-on-write) mapping that loads a page only
    when a lookup touches it, advised as random access so the kernel reads no neighbouring pages."""
    start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
    with open(entry.path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), entry.offset + entry.nbytes - start, access=mmap.ACCESS_COPY,
                            offset=start)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset - start)
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    return flat.view(*entry.shape[:-1], entry.shape[-1] * itemsize).view(entry.dtype)


def host_tensor(entry: SafetensorsEntry, pin: bool) -> torch.Tensor:
    """A copy of the tensor in (optionally pinned) host memory, read from the file in bounded chunks."""
    source = mapped_tensor(entry)
    target = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
    rows_per_chunk = max(1, HOST_COPY_CHUNK // max(1, entry.nbytes // max(1, entry.shape[0])))
    for start in range(0, source.shape[0], rows_per_chunk):
        target[start:start + rows_per_chunk].copy_(source[start:start + rows_per_chunk])
    return target


def checkpoint_file_for(folder: str | os.PathLike, name: str) -> Path:
    """The safetensors file of a checkpoint folder that holds tensor `name` (from the index, or the headers)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_weight_map(index)
        if name in weight_map:
            return folder / weight_map[name]
    else:
        for path in checkpoint_files(folder):
            if name in read_safetensors_header(path):
                return path
    raise KeyError(f"The checkpoint in {folder} holds no tensor {name!r}.")


class ExternalTable:
    """An Engram table [rows, head_dim] (plus its E8M0 scales when FP8) held in host memory or mapped from a file.

    `gather(row_ids, device)` returns the looked-up rows on `device`. From pinned host memory the host-to-device copy
    runs on a side CUDA stream, so it overlaps the layers computing meanwhile.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, storage: str) -> None:
        self.weight = weight
        self.scale = scale
        self.storage = storage
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_checkpoint(cls, folder: str | os.PathLike, prefix: str, quantized: bool, storage: str
                        ) -> "ExternalTable":
        """Open `{prefix}.weight` (and `{prefix}.scale`) of a checkpoint folder with the given storage."""
        pin = storage == "host" and torch.cuda.is_available()
        tensors = []
        for suffix in ("weight", "scale") if quantized else ("weight",):
            name = f"{prefix}.{suffix}"
            entry = safetensors_entries(checkpoint_file_for(folder, name), [name])[name]
            tensors.append(mapped_tensor(entry) if storage == "mmap" else host_tensor(entry, pin))
        return cls(tensors[0], tensors[1] if quantized else None, storage)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def gather(self, row_ids: torch.Tensor, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor | None, object | None]:
        """(weight rows, scale rows, event) on `device` for `row_ids` of any shape; on CUDA the rows are valid
        once the current stream waits for `event`."""
        ids = row_ids.to("cpu").reshape(-1)
        pin = device.type == "cuda" and self.storage == "host"
        picked = []
        for table in (self.weight, self.scale):
            if table is None:
                picked.append(None)
                continue
            out = torch.empty((ids.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=pin)
            picked.append(torch.index_select(table, 0, ids, out=out).view(*row_ids.shape, *table.shape[1:]))
        if device.type != "cuda":
            return picked[0].to(device), None if picked[1] is None else picked[1].to(device), None
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # a side stream: the copy overlaps the compute stream's work
            moved = [None if t is None else t.to(device, non_blocking=True) for t in picked]
        event = torch.cuda.Event()
        event.record(stream)
        return moved[0], moved[1], (event, stream)

    def start(self, source: torch.Tensor, slot: int, device: torch.device) -> PendingRows:
        """Begin gathering the rows of `source[:, :, slot]` for `device` on a background thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-rows")
        ids = source[:, :, slot]
        return PendingRows(source, slot, self._executor.submit(self.gather, ids, device))
