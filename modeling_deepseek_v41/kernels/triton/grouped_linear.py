"""The attention's block-diagonal output projection (wo_a) on the GPU: out[m, g] = x[m, g] @ W[g]^T for G groups
of a weight [G*R, D] (FP8 with E8M0 tiles, or dense) in one launch of the linears' kernel, with the reference's
numerics: the weight dequantized exactly in registers (to x's dtype), the activations as they are (no FP8 QDQ),
fp32 accumulation, rounded to x's dtype.

Calls of up to ROWS_MAX_ROWS rows take linear_rows' CUDA-core formulation; other decode-sized calls
(M <= DECODE_MAX_ROWS) use the linears' fixed decode tiling and a split-K from the shapes
alone, so a row's result does not depend on M; larger calls dequantize the weight once to bf16 and run one
batched cuBLAS product (the reference's einsum on the same exact values).
"""

from __future__ import annotations

import torch

from .common import FMT_DENSE, FMT_FP8_TILE
from .linear import DECODE_MAX_ROWS, dequantize_weight, run_linear
from .linear_rows import ROWS_MAX_ROWS, rows_linear


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, groups: int) -> torch.Tensor:
    """x [..., G, D] (bf16/fp32), weight [G*R, D]: e4m3 with E8M0 scale [ceil(G*R/32), ceil(D/32)], or dense with
    scale None -> [..., G, R] in x's dtype: torch.einsum("...gd,grd->...gr", x, weight exactly in x's dtype),
    without activation QDQ."""
    n_total, k = weight.shape
    if x.shape[-2:] != (groups, k) or n_total % groups:
        raise ValueError(f"grouped_linear takes x [..., {groups}, {k}] for a weight {tuple(weight.shape)}; "
                         f"got {tuple(x.shape)}")
    r = n_total // groups
    if scale is not None and (r % 32 or weight.stride(-1) != 1 or scale.element_size() != 1):
        raise ValueError("each group's rows must be whole 32-row scale tiles, the weight contiguous along K and the "
                         "scales E8M0 bytes")
    lead = x.shape[:-2]
    rows = x.reshape(-1, groups * k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if scale is None and weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = rows.shape[0]
    if m > DECODE_MAX_ROWS:  # prefill-sized: one exact bf16 copy of the weight, one batched product
        dense = weight if scale is None else dequantize_weight(weight, scale, FMT_FP8_TILE, n_total, k)
        dense = dense.to(x.dtype).view(groups, r, k)
        return torch.einsum("...gd,grd->...gr", x, dense)
    fmt = FMT_DENSE if scale is None else FMT_FP8_TILE
    if m <= ROWS_MAX_ROWS:
        narrower = scale is None and weight.dtype != x.dtype and x.dtype in (torch.bfloat16, torch.float16)
        out = rows_linear(rows, weight, scale, fmt, r, k, x.dtype, groups=groups,
                          weight_round=x.dtype if narrower else None)
    else:
        out = run_linear(rows, None, weight, scale, fmt, r, k, x.dtype, x.dtype, groups=groups)
    return out.view(*lead, groups, r)
