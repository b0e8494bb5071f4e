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
    """Whether two parts (or their nested records) hold tensors of the same shapes, dtypes and devices and host
    fields of the same types under the same names: what copying one's state into the other needs."""
    left, right = list(_leaves(a)), list(_leaves(b))
    return len(left) == len(right) and all(key == other_key and _signature(x) == _signature(y)
                                           for (_, key, x), (_, other_key, y) in zip(left, right))


def copy_state(target, source) -> None:
    """Give `target` the state of `source` (same layout), keeping every tensor of `target` where it is: tensors are
    copied in, host fields assigned. A recorded CUDA graph keeps working on `target`'s memory."""
    for (owner, key, held), (_, _, value) in zip(_leaves(target), _leaves(source)):
        if isinstance(value, torch.Tensor):
            held.copy_(value)
        else:
            setattr(owner, key, value)


def allocated_bytes(parts) -> int:
    """Bytes of every tensor the parts (or nested records) hold, as allocated."""
    return sum(leaf.nbytes for _, _, leaf in _leaves(parts) if isinstance(leaf, torch.Tensor))


def _leaves(value, owner=None, key=None):
    """(owner, name, leaf) of every tensor and host field under `value`, in a fixed order, through dicts, tuples
    and the package's own records (packed rows, column records) a part holds."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif type(value).__module__.startswith(__package__):
        items = vars(value).items()
    else:
        yield owner, key, value
        return
    for name, item in items:
        yield from _leaves(item, value, name)


def _signature(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return leaf.shape, leaf.dtype, leaf.device
    return (type(leaf),)
