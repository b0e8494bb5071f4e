"""The attention's block-diagonal output projection (wo_a) on the GPU: out[m, g] = x[m, g] @ W[g]^T for G groups
of a weight [G*R, D] (FP8 with E8M0 tiles, or dense) in one launch, with the reference's numerics: the weight
dequantized exactly in registers (to x's dtype), the activations as they are (no FP8 QDQ), fp32 accumulation,
rounded to x's dtype.

Decode-sized calls (M <= DECODE_MAX_ROWS) use the linears' fixed decode tiling and a split-K from the shapes
alone, so a row's result does not depend on M; larger calls dequantize the weight once to bf16 and run one
batched cuBLAS product (the reference's einsum on the same exact values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FMT_DENSE, FMT_FP8_TILE, cast, dot_k_range
from .linear import _TL_DTYPES, DECODE_MAX_ROWS, DECODE_TILE, _split_sum_kernel, dequantize_weight, dot_dtype_for, \
    split_count


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, R, K, k_chunk, splits,
                    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
                    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr,
                    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """out[split, m, g*R + n] = sum over this split's K range of x[m, g*K + k] w[g*R + n, k]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2) // splits
    pid_s = tl.program_id(2) % splits
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    k_start = pid_s * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, K)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    s_group = s_ptr + g * (R // 32) * stride_sn if WFMT == 1 else s_ptr
    acc = dot_k_range(acc, w_ptr + g * R * stride_wn, s_group, x_ptr + g * K, x_ptr,
                      offs_n, rows, row_mask, k_start, k_stop, R, K, stride_wn, stride_sn, stride_xm, 0,
                      BK, WFMT, False, X_DTYPE, DOT_DTYPE, IEEE)
    mask = (offs_n[:, None] < R) & row_mask[None, :]
    ptrs = out_ptr + pid_s * stride_os + rows[None, :] * stride_om + g * R + offs_n[:, None]
    tl.store(ptrs, cast(acc, out_ptr.dtype.element_ty), mask=mask)


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
    tile = DECODE_TILE
    dot_dtype = dot_dtype_for(x.device, x.dtype)
    if dot_dtype == torch.float32:
        tile = dict(tile, num_stages=2)
    splits, k_chunk = split_count(n_total, k, tile)
    out = torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, m, n_total, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(r, tile["BN"]), groups * splits)
    _grouped_kernel[grid](
        rows, weight, weight if scale is None else scale.view(torch.uint8), target, m, r, k, k_chunk, splits,
        rows.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0), m * n_total, n_total,
        BN=tile["BN"], BM=tile["BM"], BK=tile["BK"], WFMT=FMT_DENSE if scale is None else FMT_FP8_TILE,
        X_DTYPE=_TL_DTYPES[x.dtype], DOT_DTYPE=_TL_DTYPES[dot_dtype],
        IEEE=dot_dtype == torch.float32, num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    if splits > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n_total, block),)](target, out, m * n_total, splits, BLOCK=block)
    return out.view(*lead, groups, r)
