"""Shard planning and the resumable, atomic shard-by-shard writer every script here shares.

A conversion is a list of `OutputGroup`s: a few output tensors that are produced together (a quantized weight and
its scale) from a generator of row pieces. Groups are packed into shards, shards are written one at a time into a
temporary folder next to the destination, and the folder is renamed into place only when everything is written.
A progress manifest in the temporary folder lets an interrupted run skip the shards it had finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .safetensors_io import PlannedTensor, ShardWriter, shard_file_size

Piece = tuple[str, int, torch.Tensor]  # (tensor name, first row, rows)
MANIFEST = ".conversion_manifest.json"
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class DestinationExistsError(FileExistsError):
    """The output folder already exists (nothing is overwritten)."""


@dataclass
class OutputGroup:
    """Output tensors produced together by `produce()`, which yields row pieces of them."""

    tensors: list[PlannedTensor]
    produce: Callable[[], Iterator[Piece]]
    source_shard: str = ""  # shards mirror the source's when no size limit is given
    prefix: str = "model"  # output file family: "model" or a sidecar such as "hub_scales"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ShardPlan:
    """One output file and the groups it holds."""

    filename: str
    groups: list[OutputGroup] = field(default_factory=list)

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [t for g in self.groups for t in g.tensors]


def parse_size(text: str | int | None) -> int | None:
    """'500MB', '2GiB', '1000000' -> bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (examples: 500MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def plan_shards(groups: list[OutputGroup], max_shard_bytes: int | None = None) -> list[ShardPlan]:
    """Pack groups into `{prefix}-0000i-of-0000n.safetensors` files, keeping their order.

    Without a size limit each output file holds the groups of one source shard (so a round trip keeps the
    original sharding); with one, groups are packed greedily and a group larger than the limit gets its own file.
    """
    plans: list[ShardPlan] = []
    for prefix in dict.fromkeys(g.prefix for g in groups):
        buckets: list[list[OutputGroup]] = []
        if max_shard_bytes is None:
            by_source: dict[str, list[OutputGroup]] = {}
            for group in (g for g in groups if g.prefix == prefix):
                by_source.setdefault(group.source_shard, []).append(group)
            buckets = list(by_source.values())
        else:
            size = 0
            for group in (g for g in groups if g.prefix == prefix):
                if not buckets or (size + group.nbytes > max_shard_bytes and size > 0):
                    buckets.append([])
                    size = 0
                buckets[-1].append(group)
                size += group.nbytes
        total = len(buckets)
        plans += [ShardPlan(f"{prefix}-{i + 1:05d}-of-{total:05d}.safetensors", b) for i, b in enumerate(buckets)]
    return plans


def write_index(folder: Path, shards: list[ShardPlan], prefix: str = "model") -> None:
    """`{prefix}.safetensors.index.json` with metadata.total_size and the weight_map of that file family."""
    family = [s for s in shards if s.filename.startswith(f"{prefix}-")]
    weight_map = {t.name: s.filename for s in family for t in s.tensors}
    index = {"metadata": {"total_size": sum(t.nbytes for s in family for t in s.tensors)},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def plan_fingerprint(shards: list[ShardPlan], extra: object = None) -> str:
    """A digest of the planned files, tensors and inputs: a resumed run must match it exactly."""
    description = [[s.filename, [[t.name, list(t.shape), str(t.dtype)] for t in s.tensors]] for s in shards]
    return hashlib.sha256(json.dumps([description, extra], sort_keys=True, default=str).encode()).hexdigest()


def source_identity(files: list[Path]) -> list[list]:
    """Names, sizes and modification times of the input files (a changed input invalidates a resume)."""
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def partial_dir(dst: Path) -> Path:
    """The temporary folder a run writes into before renaming it to `dst`."""
    return dst.with_name(f".{dst.name}.partial")


def _save_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, folder / MANIFEST)


def _open_partial(dst: Path, fingerprint: str) -> tuple[Path, set[str]]:
    """The temporary folder and the shards a previous interrupted run of the same plan finished."""
    work = partial_dir(dst)
    if work.exists():
        manifest_path = work / MANIFEST
        if not manifest_path.exists():
            raise DestinationExistsError(f"{work} exists but was not left by this converter; remove it first.")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fingerprint:
            return work, set(manifest.get("done", []))
        shutil.rmtree(work)  # left by a run with other inputs or options: nothing in it can be reused
    work.mkdir(parents=True)
    _save_manifest(work, {"fingerprint": fingerprint, "done": []})
    return work, set()


def write_shards(dst: str | Path, shards: list[ShardPlan], finalize: Callable[[Path], None], fingerprint: str,
                 progress: bool = True, description: str = "converting") -> Path:
    """Write every shard into the temporary folder (skipping ones a previous run finished), call
    `finalize(folder)` for the small files (config, index, tokenizer), then rename the folder to `dst`."""
    from tqdm.auto import tqdm

    dst = Path(dst)
    if dst.exists():
        raise DestinationExistsError(f"{dst} already exists; choose another destination or remove it.")
    work, done = _open_partial(dst, fingerprint)
    total = sum(t.nbytes for s in shards for t in s.tensors)
    with tqdm(total=total, unit="B", unit_scale=True, desc=description, disable=not progress) as bar:
        for shard in shards:
            target = work / shard.filename
            size = shard_file_size(shard.tensors)
            if shard.filename in done and target.exists() and target.stat().st_size == size:
                bar.update(sum(t.nbytes for t in shard.tensors))
                continue
            partial = work / (shard.filename + ".tmp")
            writer = ShardWriter(partial, shard.tensors)
            try:
                for group in shard.groups:
                    for name, row_start, piece in group.produce():
                        bar.update(writer.write(name, row_start, piece))
            finally:
                writer.handle.close()
            writer.close()
            os.replace(partial, target)
            done.add(shard.filename)
            _save_manifest(work, {"fingerprint": fingerprint, "done": sorted(done)})
    finalize(work)
    (work / MANIFEST).unlink()
    os.rename(work, dst)
    return dst
