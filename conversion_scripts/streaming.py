"""Shard planning and the resumable, atomic shard-by-shard writer every script here shares.

A conversion is a list of `OutputGroup`s: a few output tensors that are produced together (a quantized weight and
its scale) from a generator of row pieces. Groups are packed into shards, shards are written one at a time into a
temporary folder next to the destination, and the folder is renamed into place only when everything is written.
A progress manifest in the temporary folder records the sha256 of every finished shard; an interrupted run reuses
a finished shard only when its file still has that digest, and rewrites it otherwise. Every piece is checked to be
finite (NaN/Inf refused, naming the tensor) unless the caller asks to keep non-finite values.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modeling_deepseek_v41.loading.weight_checks import invalid_values

from .safetensors_io import PlannedTensor, ShardWriter, shard_file_size

Piece = tuple[str, int, torch.Tensor]  # (tensor name, first row, rows)
MANIFEST = ".conversion_manifest.json"
logger = logging.getLogger(__name__)
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class DestinationExistsError(FileExistsError):
    """The output folder already exists (nothing is overwritten)."""


class NonFiniteWeightError(ValueError):
    """A tensor holds NaN or Inf values and the caller did not ask to keep them."""


def check_finite(name: str, row_start: int, piece: torch.Tensor) -> None:
    """Raise NonFiniteWeightError naming `name` when a floating piece (FP8/E8M0 included) holds NaN or Inf."""
    if not piece.is_floating_point() or piece.numel() == 0 or not bool(invalid_values(piece)):
        return  # integer storage (packed FP4, token maps) has no non-finite values; one reduction pass otherwise
    bad = ~torch.isfinite(piece if piece.dtype.itemsize > 1 else piece.float())
    if bool(bad.any()):
        first = int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0]) + row_start if piece.dim() else 0
        raise NonFiniteWeightError(
            f"tensor {name} has {int(bad.sum())} non-finite (NaN/Inf) values (first in row {first}) in this "
            "chunk; refusing to convert it. Fix the source checkpoint, or pass --keep-non-finite "
            "(keep_non_finite=True) to convert the values as they are.")


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


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _save_manifest(folder: Path, fingerprint: str, digests: dict[str, str]) -> None:
    """Replace the manifest atomically (written, flushed to disk, then renamed over the old one)."""
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps({"fingerprint": fingerprint, "digests": dict(sorted(digests.items()))}))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST)


def _open_partial(dst: Path, fingerprint: str) -> tuple[Path, dict[str, str]]:
    """The temporary folder and the sha256 of each shard a previous interrupted run of the same plan finished."""
    work = partial_dir(dst)
    if work.exists():
        manifest_path = work / MANIFEST
        if not manifest_path.exists():
            raise DestinationExistsError(f"{work} exists but was not left by this converter; remove it first.")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            manifest = {}  # a damaged manifest vouches for nothing: start over
        manifest = manifest if isinstance(manifest, dict) else {}
        digests = manifest.get("digests")
        if manifest.get("fingerprint") == fingerprint and isinstance(digests, dict):
            return work, {str(k): str(v) for k, v in digests.items()}
        shutil.rmtree(work)  # left by a run with other inputs or options: nothing in it can be reused
    work.mkdir(parents=True)
    _save_manifest(work, fingerprint, {})
    return work, {}


def _reusable(target: Path, size: int, digest: str | None) -> bool:
    """A finished shard is reused only when it has its planned size and the digest recorded when it was written."""
    if digest is None or not target.exists():
        return False
    if target.stat().st_size == size and file_digest(target) == digest:
        return True
    logger.warning("%s: its content does not match the sha256 recorded when it was finished (corrupted or "
                   "modified since); rewriting it.", target.name)
    return False


def _write_shard(work: Path, shard: ShardPlan, bar, keep_non_finite: bool) -> str:
    """Write one shard to a temporary file, flush it to disk, rename it into place; returns its sha256.

    On any failure the temporary file is removed, so nothing half-written is left for a later run."""
    target, partial = work / shard.filename, work / (shard.filename + ".tmp")
    writer = ShardWriter(partial, shard.tensors)
    try:
        try:
            for group in shard.groups:
                for name, row_start, piece in group.produce():
                    if not keep_non_finite:
                        check_finite(name, row_start, piece)
                    bar.update(writer.write(name, row_start, piece))
            writer.handle.flush()
            os.fsync(writer.handle.fileno())
        finally:
            writer.handle.close()
        writer.close()
        digest = file_digest(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    return digest


def write_shards(dst: str | Path, shards: list[ShardPlan], finalize: Callable[[Path], None], fingerprint: str,
                 progress: bool = True, description: str = "converting", keep_non_finite: bool = False) -> Path:
    """Write every shard into the temporary folder (reusing the ones a previous run finished whose content still
    matches their recorded sha256), call `finalize(folder)` for the small files (config, index, tokenizer), then
    rename the folder to `dst`. Raises NonFiniteWeightError on NaN/Inf values unless `keep_non_finite`."""
    from tqdm.auto import tqdm

    dst = Path(dst)
    if dst.exists():
        raise DestinationExistsError(f"{dst} already exists; choose another destination or remove it.")
    work, digests = _open_partial(dst, fingerprint)
    planned = {shard.filename for shard in shards}
    digests = {name: digest for name, digest in digests.items() if name in planned}
    total = sum(t.nbytes for s in shards for t in s.tensors)
    with tqdm(total=total, unit="B", unit_scale=True, desc=description, disable=not progress) as bar:
        for shard in shards:
            if _reusable(work / shard.filename, shard_file_size(shard.tensors), digests.get(shard.filename)):
                bar.update(sum(t.nbytes for t in shard.tensors))
                continue
            if digests.pop(shard.filename, None) is not None:
                _save_manifest(work, fingerprint, digests)  # a crash from here on must not vouch for the old file
            digests[shard.filename] = _write_shard(work, shard, bar, keep_non_finite)
            _save_manifest(work, fingerprint, digests)
    finalize(work)
    (work / MANIFEST).unlink()
    os.rename(work, dst)
    return dst
