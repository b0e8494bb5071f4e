"""The parts a DeepseekV41Cache owns, allocated together on its first forward (sized by its layer plan: the column
log, a window `Ring` per layer and per DSpark drafter stage, a `Pool` per KV source) and counted together."""

from __future__ import annotations

import torch

from ..kernels.numerics import compute_dtype
from .columns import ColumnLog
from .pool import Pool
from .ring import Ring


def allocate_parts(specs, text_config, crop_horizon: int, batch: int, device: torch.device,
                   model_dtype: torch.dtype) -> tuple[ColumnLog, dict[int, Ring], dict[int, Pool]]:
    """(the log, the rings, the pools) for `batch` rows of the layers in `specs`: a ring of `sliding_window +
    crop_horizon` slots for each, a pool for each pool owner among them."""
    projection_dtype = compute_dtype(model_dtype)  # the compressor's fp32 (or float64) projections
    rings, pools = {}, {}
    for spec in specs:
        rings[spec.layer_id] = Ring(text_config.sliding_window + crop_horizon, text_config.head_dim, batch, device)
        if spec.owns_pool:
            pools[spec.layer_id] = Pool(spec.ratio, text_config.head_dim, text_config.index_head_dim, batch,
                                        crop_horizon, device, projection_dtype)
    return ColumnLog(batch, device), rings, pools


def parts_nbytes(log: ColumnLog | None, pools: dict[int, Pool], rings: dict[int, Ring]) -> dict[str, int]:
    """Bytes in use by component: the pools' rows and index keys (global KV), the rings (as allocated), the pools'
    carries and raw recent tokens, the log's Engram history."""
    if log is None:
        return {"global_kv": 0, "window": 0, "carry": 0, "engram_history": 0}
    pool_bytes = [pool.nbytes(log.lengths) for pool in pools.values()]
    return {"global_kv": sum(kv for kv, _ in pool_bytes), "window": sum(ring.nbytes for ring in rings.values()),
            "carry": sum(carry for _, carry in pool_bytes), "engram_history": log.history_bytes()}


def same_layout(a, b) -> bool:
    """Whether two parts (or their nested records) hold tensors of the same shapes, dtypes and devices under the
    same names: what copying one's state into the other needs."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_layout(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_layout(x, y) for x, y in zip(a, b))
    if _is_record(a):
        return vars(a).keys() == vars(b).keys() and all(same_layout(v, vars(b)[k]) for k, v in vars(a).items())
    return True  # host fields: any value


def copy_state(target, source) -> None:
    """Give `target` the state of `source` (same layout), keeping every tensor of `target` where it is: tensors are
    copied in, host fields assigned. A recorded CUDA graph keeps working on `target`'s memory."""
    if isinstance(target, dict):
        for key in target:
            copy_state(target[key], source[key])
        return
    for name, value in vars(source).items():
        held = getattr(target, name)
        if isinstance(value, torch.Tensor):
            held.copy_(value)
        elif isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
            for into, part in zip(held, value):
                into.copy_(part)
        elif _is_record(value):
            copy_state(held, value)
        else:
            setattr(target, name, value)


def allocated_bytes(parts) -> int:
    """Bytes of every tensor the parts (or nested records) hold, as allocated."""
    if isinstance(parts, torch.Tensor):
        return parts.nbytes
    if isinstance(parts, dict):
        return sum(allocated_bytes(v) for v in parts.values())
    if isinstance(parts, (tuple, list)):
        return sum(allocated_bytes(v) for v in parts)
    return sum(allocated_bytes(v) for v in vars(parts).values()) if _is_record(parts) else 0


def _is_record(value) -> bool:
    """The package's own objects that a part holds (packed rows, column records)."""
    return type(value).__module__.startswith(__package__)
