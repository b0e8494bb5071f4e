"""Scratch memory the kernels share: arrival counters and partials for the split reductions done in one launch.

A split-K launch counts, per output tile, the programs that stored their partial sums; the last to arrive sums
them and sets the count back to zero (`common.arrive_last`). So the counters are zero before every launch without
a memset per call (one graph node less per linear). Kernels on one stream run one after another, so one counter
array per (device, stream) serves every launch on it.
"""

from __future__ import annotations

import torch

COUNTERS = 1 << 16  # more tiles than any launch at the released widths has (the largest: ~2,000)

_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters for `tiles` tiles on `device`'s current stream (interpreter: a fresh zeroed array)."""
    if tiles > COUNTERS:
        raise ValueError(f"a launch with {tiles} split tiles exceeds the {COUNTERS} arrival counters")
    if device.type != "cuda":
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    counts = _counters.get(key)
    if counts is None:
        counts = _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counts


def split_buffers(splits: int, shape: tuple, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials [splits, *shape] and the zeroed arrival counts of the tiles for a split-K launch (empty
    stand-ins of the same dtypes when there is one split, so both launches share one compiled kernel)."""
    if splits == 1:
        return (torch.empty(0, dtype=torch.float32, device=device), torch.empty(0, dtype=torch.int32, device=device))
    return torch.empty(splits, *shape, dtype=torch.float32, device=device), arrival_counts(device, tiles)
