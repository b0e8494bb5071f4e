"""Linears on the GPU: block-scaled FP8, packed FP4 (or its FP8 re-encode) and dense bf16/fp32 weights.

Two regimes, chosen by the row count M only:
- decode (M <= DECODE_MAX_ROWS): one fixed tiling (64 weight rows x 32 token columns, swapped so the weight fills
  the tensor core's wide side) and a split-K count that depends on (N, K) alone, so a row's result never depends on
  M or on the other rows (batch invariant). Quantized weights are dequantized exactly to bf16 in registers and
  multiplied with the exactly QDQ'd activations (exact in bf16) with fp32 accumulation: the emulation's numbers up
  to fp32 summation order. With M <= 32 every weight byte is read once per call.
  fp8_dot=True instead multiplies the e4m3 weight (FP4 nibbles re-encoded to e4m3 in registers) with the e4m3
  activations on FP8 tensor cores, both power-of-two scales applied to each 32-wide K slice's result: faster, but
  Hopper's FP8 dots sum with less than fp32 precision (4.6e-5 relative error measured on the H200).
- prefill (M > DECODE_MAX_ROWS): the weight is dequantized exactly to a bf16 scratch copy and multiplied by cuBLAS
  with the exactly QDQ'd activations (bf16 products are exact, accumulation fp32): compute-bound, so the copy
  costs little next to the GEMM.
fp8_dot=True/False forces the Triton kernel with FP8 / exact bf16 dots at any M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (FMT_DENSE, FMT_FP4_ROW, FMT_FP8_ROW, FMT_FP8_TILE, cast, dot_k_range, k_slice, weight_scale,
                     weight_slice)
from .quant import fp8_act_qdq, fp8_act_quant

DECODE_MAX_ROWS = 256
DECODE_TILE = {"BN": 64, "BM": 32, "BK": 128, "num_warps": 4, "num_stages": 3}
PREFILL_TILE = {"BN": 128, "BM": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
SPLIT_TARGET_PROGRAMS = 264  # about two waves on a 132-SM H200; a constant, so the split depends on (N, K) only


@triton.jit
def _linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_chunk,
                   stride_xm, stride_xsm, stride_wn, stride_sn, stride_os, stride_om,
                   BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr,
                   FP8_DOT: tl.constexpr, X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """out[split, m, n] = sum over this split's K range of x[m, k] w[n, k] (acc[BN, BM] holds the transpose)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    k_start = pid_s * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, K)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    acc = dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, row_mask, k_start, k_stop, N, K,
                      stride_wn, stride_sn, stride_xm, stride_xsm, BK, WFMT, FP8_DOT, X_DTYPE, DOT_DTYPE, IEEE)
    mask = (offs_n[:, None] < N) & row_mask[None, :]
    ptrs = out_ptr + pid_s * stride_os + rows[None, :] * stride_om + offs_n[:, None]
    tl.store(ptrs, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BN: tl.constexpr, WFMT: tl.constexpr):
    """out[n, k] = weight value x scale in bf16 (exact), one [BN, 32] slice per program."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * 32
    w = weight_slice(w_ptr, offs_n, k0, N, K, stride_wn, WFMT).to(tl.float32)
    w = w * weight_scale(s_ptr, offs_n, k0, N, K, stride_sn, WFMT)[:, None]
    cols = k_slice(k0, WFMT)
    tl.store(out_ptr + offs_n[:, None] * stride_on + cols[None, :], w.to(tl.bfloat16),
             mask=(offs_n < N)[:, None] & (cols < K)[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, total, splits, BLOCK: tl.constexpr):
    """out = sum of the split partials in split order (fixed, so deterministic), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, cast(acc, out_ptr.dtype.element_ty), mask=mask)


def split_count(n: int, k: int, tile: dict = DECODE_TILE) -> tuple[int, int]:
    """(splits, K columns per split) for the decode regime: enough programs to fill the GPU at M = 1, from the
    weight's shape alone."""
    k_blocks = triton.cdiv(k, tile["BK"])
    wanted = max(1, triton.cdiv(SPLIT_TARGET_PROGRAMS, triton.cdiv(n, tile["BN"])))
    per_split = triton.cdiv(k_blocks, min(k_blocks, wanted))
    return triton.cdiv(k_blocks, per_split), per_split * tile["BK"]


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_dtype_for(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dot's operand dtype. On the CPU (Triton's interpreter, whose dots on 16-bit floats are wrong) the same
    values go through an fp32 dot: they are exact in bf16, so only the summation order can differ."""
    return torch.float32 if device.type == "cpu" else dtype


def _run(x2d: torch.Tensor, xs: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor | None, fmt: int,
         n: int, k: int, out_dtype: torch.dtype, fp8_dot: bool, dot_dtype: torch.dtype) -> torch.Tensor:
    m = x2d.shape[0]
    x_dtype = dot_dtype
    dot_dtype = dot_dtype_for(x2d.device, dot_dtype)
    decode = m <= DECODE_MAX_ROWS
    tile = DECODE_TILE if decode else PREFILL_TILE
    if dot_dtype == torch.float32:  # fp32 operands take twice the shared memory per pipeline stage
        tile = dict(tile, num_stages=2)
    splits, k_chunk = split_count(n, k, tile) if decode else (1, triton.cdiv(k, tile["BK"]) * tile["BK"])
    out = torch.empty(m, n, dtype=out_dtype, device=x2d.device)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x2d.device)
    s_arg = weight if scale is None else scale.view(torch.uint8)
    xs_arg = x2d if xs is None else xs
    grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(n, tile["BN"]), splits)
    _linear_kernel[grid](
        x2d, xs_arg, weight, s_arg, target, m, n, k, k_chunk,
        x2d.stride(0), xs_arg.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0),
        m * n, n, BN=tile["BN"], BM=tile["BM"], BK=tile["BK"], WFMT=fmt, FP8_DOT=fp8_dot,
        X_DTYPE=_TL_DTYPES[x_dtype], DOT_DTYPE=_TL_DTYPES[dot_dtype], IEEE=dot_dtype == torch.float32,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    if splits > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, splits, BLOCK=block)
    return out


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """The exact bf16 [N, K] of a stored FP8 / FP4 / re-encoded weight (the prefill path's scratch copy)."""
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    bn = 64
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, 32))](
        weight, scale.view(torch.uint8), out, n, k, weight.stride(0), scale.stride(0), out.stride(0), BN=bn,
        WFMT=fmt)
    return out


def _quantized(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: int, n: int, k: int,
               fp8_dot: bool | None) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if weight.stride(-1) != 1 or scale.element_size() != 1:
        raise ValueError("the weight must be contiguous along K and the scales E8M0 (float8_e8m0fnu or uint8 bytes)")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if fp8_dot is None and rows.shape[0] > DECODE_MAX_ROWS:
        dense = dequantize_weight(weight, scale, fmt, n, k)
        qdq = fp8_act_qdq(rows, torch.bfloat16)
        if x.dtype == torch.bfloat16:
            out = torch.nn.functional.linear(qdq, dense)
        else:
            out = torch.nn.functional.linear(qdq.float(), dense.float()).to(x.dtype)
        return out.view(*x.shape[:-1], n)
    if fp8_dot:
        q, xs = fp8_act_quant(rows)
        out = _run(q, xs, weight, scale, fmt, n, k, x.dtype, True, torch.bfloat16)
    else:
        out = _run(fp8_act_qdq(rows, torch.bfloat16), None, weight, scale, fmt, n, k, x.dtype, False,
                   torch.bfloat16)
    return out.view(*x.shape[:-1], n)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp8_dot: bool | None = None
               ) -> torch.Tensor:
    """DeepseekV41Linear.forward for FP8 storage: x [..., K] (bf16/fp32) -> [..., N] in x's dtype.

    weight: e4m3 [N, K] contiguous; scale: E8M0 (float8_e8m0fnu or its uint8 bytes) [ceil(N/32), ceil(K/32)].
    fp8_dot: None picks the regime's default (see the module doc); True/False force the Triton kernel with FP8 or
    exact bf16 dots."""
    n, k = weight.shape
    return _quantized(x, weight, scale, FMT_FP8_TILE, n, k, fp8_dot)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, fp8_dot: bool | None = None
               ) -> torch.Tensor:
    """DeepseekV41Linear.forward for FP4 storage: packed e2m1 [N, K/2] (int8, even element in the low nibble),
    E8M0 scale [N, K/32]; the nibbles become e4m3 in registers (W4A8 on FP8 tensor cores; fp8_dot=False: W4A16)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return _quantized(x, packed, scale, FMT_FP4_ROW, n, k, fp8_dot)


def fp8_row_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp8_dot: bool | None = None
                   ) -> torch.Tensor:
    """fp4_linear for a weight re-encoded at load by quant.fp4_to_fp8_weight: e4m3 [N, K], E8M0 scale [N, K/32]."""
    n, k = weight.shape
    return _quantized(x, weight, scale, FMT_FP8_ROW, n, k, fp8_dot)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact bf16 [N, K] of an FP8 weight e4m3 [N, K] with E8M0 scales per 32x32 tile."""
    n, k = weight.shape
    return dequantize_weight(weight, scale, FMT_FP8_TILE, n, k)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact bf16 [N, K] of a packed e2m1 weight [N, K/2] with E8M0 scales per (row, 32)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return dequantize_weight(packed, scale, FMT_FP4_ROW, n, k)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.to(weight.dtype), weight) for a bf16/fp16/fp32 weight [N, K], batch invariant up to
    DECODE_MAX_ROWS rows (cuBLAS picks its kernel by M). fp32 weights use true fp32 products (no TF32)."""
    if weight.dtype not in _TL_DTYPES:
        raise TypeError(f"dense_linear takes a bf16, fp16 or fp32 weight, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] > DECODE_MAX_ROWS:  # prefill-sized: cuBLAS
        out = torch.nn.functional.linear(rows.to(weight.dtype), weight)
    else:
        out = _run(rows, None, weight, None, FMT_DENSE, n, k, weight.dtype, False, weight.dtype)
    return out.view(*x.shape[:-1], n)
