"""The persistent prefix cache: a DeepseekV41Cache saved to disk and restored in another process.

Only what the CED design keeps on SSD is stored: the packed global KV (compressed rows and index keys of every
pool), the ratio-r carries and the token ids (from which the Engram history is rebuilt), with a format version, the
fingerprint of what they depend on (`fingerprint.py`) and one sha256 over header and payload. Window KV is not
stored: a restored cache rebuilds it by bounded replay of the last `sliding_window` tokens on its next forward
(those tokens never rewrite the pools). The file's tensor names are this module's; what each part keeps and how it
is filled again are the parts' public `saved` and `restore` (the cache's `log`, each of its `pools`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from ..layers.engram_hashing import DEAD
from .fingerprint import fingerprint, fingerprint_mismatch

FORMAT_VERSION = "2"  # 2: fingerprint parts (weights, token map, config) and one checksum over header and payload
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError, OverflowError,
                UnicodeDecodeError)  # what a corrupted file can raise while its header and tensors are read


def content_checksum(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every header field but the checksum and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "checksum"},
                                       sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    return digest.hexdigest()


def compressed_history(model, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The Engram history of saved token ids: compressed ids, dead at image-span positions and padding."""
    if not hasattr(model.base_model, "engram_token_map"):
        return torch.full_like(tokens, DEAD)
    dead = ~real | (tokens == model.config.image_token_id)
    return model.base_model.engram_token_map[tokens].masked_fill(dead, DEAD)


def prefix_tensors(cache) -> dict[str, torch.Tensor]:
    """The tensors a saved prefix holds: the log's token ids, real-token flags and lengths, and every pool's packed
    rows, index keys and carry (named `pool.{source}.{part}`)."""
    tensors = cache.log.saved()
    for source, pool in cache.pools.items():
        tensors.update({f"pool.{source}.{name}": t for name, t in pool.saved(cache.lengths).items()})
    return tensors


def restore_prefix(cache, tensors: dict[str, torch.Tensor], history: torch.Tensor, model_dtype: torch.dtype
                   ) -> None:
    """Fill the new `cache` from `prefix_tensors`' tensors (on the model's device) and their Engram history."""
    tokens = tensors["tokens"]
    cache.prepare_rows(tokens.shape[0], tokens.device, model_dtype)
    cache.log.restore(tokens.long(), tensors["real"].bool(), history, tensors["lengths"])
    for source, pool in cache.pools.items():
        prefix = f"pool.{source}."
        pool.restore({name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)},
                     cache.lengths)
    cache.mark_restored()


def save_cache(cache, path: str | os.PathLike, model) -> Path:
    """Write `cache` to `path` atomically (a temporary file in the same folder, then a rename)."""
    if not cache.is_initialized or cache.columns == 0:
        raise ValueError("There is nothing to save: the cache is empty.")
    replay = min(cache.text_config.sliding_window, cache.columns)
    # the Engram history is rebuilt from the token ids on restore (images and padding are dead), so per token
    # only the id (int32) and the real-token flag are stored beside the global KV
    tensors = prefix_tensors(cache)
    if bool(((cache.history[:, -replay:] < 0) & tensors["real"][:, -replay:].bool()).any()):
        raise ValueError(
            f"The last {replay} tokens of the prefix include image positions; a saved prefix must end with at "
            "least sliding_window text tokens, because restoring replays them as text."
        )
    tensors = {name: t.detach().cpu() for name, t in tensors.items()}
    metadata = {"format_version": FORMAT_VERSION, "columns": str(cache.columns), **fingerprint(model)}
    metadata["checksum"] = content_checksum(metadata, tensors)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, tensors, metadata)
    return path


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A reader sees the old file or the new one, never a partial one: write a temporary file in the same folder,
    fsync it, rename it over `path`, fsync the folder."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(save(tensors, metadata=metadata))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_saved(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A saved cache file's header fields and tensors (on the CPU), unchecked; a clear error if unreadable."""
    try:
        with safe_open(path, framework="pt") as handle:
            return dict(handle.metadata() or {}), {name: handle.get_tensor(name) for name in handle.keys()}
    except _READ_ERRORS as error:
        raise ValueError(f"{path} is not a readable saved cache (truncated or corrupted?): {error}") from error


def load_cache(cache_class, path: str | os.PathLike, model, dspark: bool, crop_horizon: int):
    """Restore a saved prefix for `model` into a new `cache_class`. Every problem is reported before a cache is
    built."""
    path = Path(path)
    metadata, tensors = read_saved(path)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has cache format {metadata.get('format_version')!r}; this code reads "
                         f"{FORMAT_VERSION!r}: save the prefix again with this version.")
    # the checksum (hashlib hashes without the GIL) beside the weights digest, a corrupted file still reported first
    with ThreadPoolExecutor(max_workers=1) as worker:
        checksum = worker.submit(content_checksum, metadata, tensors)
        try:
            mismatch, failure = fingerprint_mismatch(metadata, model), None
        except Exception as error:  # noqa: BLE001  (raised below unless the file is corrupted)
            mismatch, failure = None, error
        intact = metadata.get("checksum") == checksum.result()
    if not intact:
        raise ValueError(f"{path} is corrupted: its header or payload fails its checksum (sha256); save the prefix "
                         "again.")
    if failure is not None:
        raise failure
    if mismatch is not None:
        raise ValueError(f"{path} was saved from another model: {mismatch}. A prefix cache can only be restored "
                         "into the model (weights, tokenizer, config) that wrote it; save it again from this one.")
    cache = cache_class(model.config, crop_horizon=crop_horizon, dspark=dspark)
    embeddings = model.get_input_embeddings().weight
    state = {name: t.to(embeddings.device) for name, t in tensors.items()}
    restore_prefix(cache, state, compressed_history(model, state["tokens"].long(), state["real"].bool()),
                   embeddings.dtype)
    return cache
