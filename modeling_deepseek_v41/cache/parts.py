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
