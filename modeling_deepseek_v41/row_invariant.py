"""Linear layers whose results do not depend on how many rows (tokens) one call processes.

CPU GEMM kernels for fp32 and float64 handle a row count that is not a multiple of 4 with another summation
order, so the same token can get a last-bit-different result when it is processed alone (decode) or with others
(prefill, draft verification). Padding the rows to a multiple of 4 gives every token the same kernel path, so a
forward over k tokens equals k single-token forwards bit for bit. bf16 GEMMs are row-count invariant already.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

_ROW_MULTIPLE = 4


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), padded to a multiple of 4 rows for fp32/float64 so results are row-count invariant."""
    if x.dtype not in (torch.float32, torch.float64) or x.device.type != "cpu":
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    pad = -rows.shape[0] % _ROW_MULTIPLE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = F.linear(rows, weight)
    if pad:
        out = out[: out.shape[0] - pad]
    return out.reshape(*x.shape[:-1], weight.shape[0])
