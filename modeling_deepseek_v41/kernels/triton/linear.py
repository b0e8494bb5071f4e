"""Linears on the GPU: block-scaled FP8, packed FP4 (or its FP8 re-encode) and dense bf16/fp32 weights.

Quantized weights: each [BN, BK] weight tile (packed FP4: its even and its odd columns) is dequantized exactly to
bf16 in registers (e4m3/e2m1 values times powers of two) and multiplied with the exactly QDQ'd activations
(quant.fp8_act_qdq, exact in bf16; done on the tile inside the linear it was 2-2.5x slower, every program repeating
it) in a tensor-core dot: exact products, fp32 accumulation, so the emulation's numbers up to fp32 summation order.
fp8_dot=True multiplies the e4m3 values on the FP8 tensor cores instead, 32 columns per dot with both scales
applied to each slice's result: Hopper's FP8 dots sum with less than fp32 precision (4.6e-5 relative error
measured on the H200).

Three regimes, chosen by the row count M only:
- rows (M <= ROWS_MAX_ROWS, FP8 and bf16/fp16 weights): linear_rows.py, the weight streamed once through the CUDA
  cores into each row's fp32 FMAs (a tensor-core tile would pad the rows to 32).
- decode (M <= DECODE_MAX_ROWS): one tiling (weight rows x token columns, swapped so the weight fills the tensor
  core's wide side) and a split-K count that depend on (N, K) alone, so a row's result never depends on M or on the
  other rows (batch invariant). The split partials are summed in split order by the last program of each tile,
  in the same launch. With M <= BM every weight byte is read once per call.
- with mma_choice.use_mma_linears on, FP8 weights at every decode size (M <= DECODE_MAX_ROWS) go through
  fp8_mma.py instead: mma.sync with the weights as the wide operand and 8-32 rows as the narrow one (no padding
  of one row to a tile), batch invariant across all those sizes; dense weights through dense_mma.py (bf16/fp16,
  and fp32 ones with bf16 rows, the head, each weight as three exact bf16 pieces, instead of fp32_rows.py).
- prefill (M > DECODE_MAX_ROWS): the weight is dequantized exactly to a bf16 scratch copy and multiplied by cuBLAS
  with the exactly QDQ'd activations (bf16 products are exact, accumulation fp32): compute-bound, so the copy
  costs little next to the GEMM. fp8_dot=True/False forces the Triton kernel at any M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (FMT_DENSE, FMT_FP4_ROW, FMT_FP8_ROW, FMT_FP8_TILE, FP8_TILE, cast, dot_k_range, k_slice,
                     weight_scale, weight_slice)
from .fp32_rows import fp32_rows_linear
from .linear_rows import ROWS_MAX_ROWS, rows_linear
from .mma_choice import mma_linears_enabled
from .quant import fp8_act_qdq, fp8_act_quant
from .splits import arrive_last, pair_operands, sum_partials
from .workspace import split_buffers
from .launch import launch_options, wait_for_inputs

DECODE_MAX_ROWS = 256
# the fastest single tiling over the released shapes at 1 and 32 rows (benchmarks/kernel_tuning.py)
DECODE_TILE = {"BN": 64, "BM": 32, "BK": 128, "num_warps": 4, "num_stages": 3}
PREFILL_TILE = {"BN": 128, "BM": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
SPLIT_TARGET_PROGRAMS = 264  # about two waves on a 132-SM H200; a constant, so the split depends on (N, K) only


@triton.jit
def _linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_chunk, splits,
                   stride_xm, stride_xsm, stride_wn, stride_sn, stride_om, stride_pm,
                   w2_ptr, s2_ptr, out2_ptr, N2, tiles1, stride_o2m,
                   BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, WFMT: tl.constexpr,
                   FP8_DOT: tl.constexpr, X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
                   PAIR: tl.constexpr):
    """out[m, g*N + n] = sum over k of x[m, g*K + k] w[g*N + n, k] for the group g of the grid's third axis (a
    plain linear is one group), this program's split of K only; acc[BN, BM] holds the transpose.
    PAIR: a second weight w2 [N2, K] (same storage) on the same input: its tiles follow the first's `tiles1` tiles
    on the grid's second axis and write out2; the split partials [splits, M, N + N2] hold both."""
    wait_for_inputs()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2) // splits
    pid_s = tl.program_id(2) % splits
    tile = (g * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
    part_col = g * N  # the tile's first column in the partials
    if PAIR:
        w_ptr, s_ptr, out_ptr, stride_om, part_col, pid_n, N = pair_operands(
            pid_n, tiles1, w_ptr, s_ptr, out_ptr, stride_om, N, w2_ptr, s2_ptr, out2_ptr, stride_o2m, N2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    row_mask = rows < M
    k_start = pid_s * k_chunk
    k_stop = tl.minimum(k_start + k_chunk, K)
    scale_rows = g * N // 32 if WFMT == FP8_TILE else g * N  # a group's first scale row: 32x32 tiles or one per row
    acc = tl.full([BN, BM], 0.0, tl.float32)
    acc = dot_k_range(acc, w_ptr + g * N * stride_wn, s_ptr + scale_rows * stride_sn, x_ptr + g * K,
                      xs_ptr + g * (K // 32), offs_n, rows, row_mask, k_start, k_stop, N, K, stride_wn, stride_sn,
                      stride_xm, stride_xsm, BK, WFMT, FP8_DOT, X_DTYPE, DOT_DTYPE, IEEE)
    mask = (offs_n[:, None] < N) & row_mask[None, :]
    offs = rows[None, :] * stride_om + g * N + offs_n[:, None]
    if splits == 1:
        tl.store(out_ptr + offs, cast(acc, out_ptr.dtype.element_ty), mask=mask)
    else:
        split_stride = M * stride_pm
        part_offs = rows[None, :] * stride_pm + part_col + offs_n[:, None]
        tl.store(part_ptr + pid_s * split_stride + part_offs, acc, mask=mask)
        if arrive_last(count_ptr, tile, splits):
            total = sum_partials(part_ptr, part_offs, mask, splits, split_stride)
            tl.store(out_ptr + offs, cast(total, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BN: tl.constexpr, WFMT: tl.constexpr):
    """out[n, k] = weight value x scale in bf16 (exact), one [BN, 32] slice per program."""
    wait_for_inputs()
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * 32
    w = weight_slice(w_ptr, offs_n, k0, N, K, stride_wn, WFMT).to(tl.float32)
    w = w * weight_scale(s_ptr, offs_n, k0, N, K, stride_sn, WFMT)[:, None]
    cols = k_slice(k0, WFMT)
    tl.store(out_ptr + offs_n[:, None] * stride_on + cols[None, :], w.to(tl.bfloat16),
             mask=(offs_n < N)[:, None] & (cols < K)[None, :])


def split_count(n: int, k: int, tile: dict = DECODE_TILE, target: int = SPLIT_TARGET_PROGRAMS) -> tuple[int, int]:
    """(splits, K columns per split) for the decode regime: enough programs to fill the GPU at M = 1, from the
    weight's shape alone."""
    k_blocks = triton.cdiv(k, tile["BK"])
    wanted = max(1, triton.cdiv(target, triton.cdiv(n, tile["BN"])))
    per_split = triton.cdiv(k_blocks, min(k_blocks, wanted))
    return triton.cdiv(k_blocks, per_split), per_split * tile["BK"]


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.float8e4nv}


def launch_tile(tile: dict, dot_dtype: torch.dtype) -> dict:
    """The tile as launched: fp32 operands (the interpreter's dots) take twice the shared memory per pipeline stage,
    so two stages."""
    return dict(tile, num_stages=2) if dot_dtype == torch.float32 else tile


def dot_dtype_for(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dot's operand dtype. On the CPU (Triton's interpreter, whose dots on 8- and 16-bit floats are wrong) the
    same values go through an fp32 dot: they are exact in fp16/bf16, so only the summation order can differ."""
    return torch.float32 if device.type == "cpu" else dtype


def run_linear(x2d: torch.Tensor, xs: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor | None,
               fmt: int, n: int, k: int, out_dtype: torch.dtype, dot_dtype: torch.dtype, groups: int = 1,
               tile: dict | None = None, split_target: int = SPLIT_TARGET_PROGRAMS,
               second: tuple[torch.Tensor, torch.Tensor | None, int] | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out [M, groups * n] = x2d [M, groups * k] times each group's n rows of the weight, in the Triton kernel.

    xs: the fp32 scales of e4m3 activations x2d (quantized weights on the FP8 tensor cores); None: the weight
    dequantized to dot_dtype, the activations rounded to it. second: (weight2, scale2, n2) of a second weight of
    the same storage on the same input, in the same launch (one group only): returns (out [M, n], out2 [M, n2]);
    the split follows from (n + n2, k). `tile`/`split_target` override the regime's tiling (benchmarks only: the
    decode tiling must stay a function of the weights' shapes)."""
    m = x2d.shape[0]
    x_dtype = dot_dtype
    dot_dtype = dot_dtype_for(x2d.device, dot_dtype)
    decode = m <= DECODE_MAX_ROWS
    tile = tile or (DECODE_TILE if decode else PREFILL_TILE)
    tile = launch_tile(tile, dot_dtype)
    w2, s2, n2 = second if second is not None else (weight, scale, 0)
    if second is not None and (groups != 1 or w2.stride(0) != weight.stride(0)
                               or (scale is not None and s2.stride(0) != scale.stride(0))):
        raise ValueError("a pair of linears takes one group and two weights of the same K and strides")
    columns = groups * n + n2
    splits, k_chunk = split_count(columns, k, tile, split_target) if decode else \
        (1, triton.cdiv(k, tile["BK"]) * tile["BK"])
    out = torch.empty(m, groups * n, dtype=out_dtype, device=x2d.device)
    out2 = torch.empty(m, n2, dtype=out_dtype, device=x2d.device) if second is not None else out
    tiles1 = triton.cdiv(n, tile["BN"])
    grid = (triton.cdiv(m, tile["BM"]), tiles1 + triton.cdiv(n2, tile["BN"]), groups * splits)
    part, count = split_buffers(splits, (m, columns), grid[0] * grid[1] * groups, x2d.device)
    s_arg = weight if scale is None else scale.view(torch.uint8)
    s2_arg = s_arg if s2 is None else s2.view(torch.uint8)
    xs_arg = x2d if xs is None else xs
    _linear_kernel[grid](
        x2d, xs_arg, weight, s_arg, out, part, count, m, n, k, k_chunk, splits,
        x2d.stride(0), xs_arg.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0), out.stride(0),
        columns, w2, s2_arg, out2, n2, tiles1, out2.stride(0),
        BN=tile["BN"], BM=tile["BM"], BK=tile["BK"], WFMT=fmt, FP8_DOT=xs is not None,
        X_DTYPE=_TL_DTYPES[x_dtype], DOT_DTYPE=_TL_DTYPES[dot_dtype], IEEE=dot_dtype == torch.float32,
        PAIR=second is not None, num_warps=tile["num_warps"], num_stages=tile["num_stages"], **launch_options())
    return (out, out2) if second is not None else out


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """The exact bf16 [N, K] of a stored FP8 / FP4 / re-encoded weight (the prefill path's scratch copy)."""
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    bn = 64
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, 32))](
        weight, scale.view(torch.uint8), out, n, k, weight.stride(0), scale.stride(0), out.stride(0), BN=bn,
        WFMT=fmt, **launch_options())
    return out


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as rows [M, K], contiguous along K (the kernels' loads assume it)."""
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _on_tensor_cores(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether an FP8 linear (or pair) of decode size goes through fp8_mma.py (mma_choice)."""
    return (mma_linears_enabled() and rows.is_cuda and rows.dtype in (torch.bfloat16, torch.float32)
            and rows.shape[1] % 128 == 0 and all(w.is_contiguous() for w in weights))


def _mma_linear(*args, **kwargs):
    from .fp8_mma import fp8_mma_linear  # Gluon, imported on the GPU path only
    return fp8_mma_linear(*args, **kwargs)


def _dense_on_tensor_cores(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a decode-sized dense linear (or pair) goes through dense_mma.py (mma_choice): bf16/fp16 weights (the
    rows cast to their dtype), or fp32 weights with bf16 rows; K a multiple of 32, contiguous weights."""
    dtype = weights[0].dtype
    return (mma_linears_enabled() and rows.is_cuda and rows.shape[1] % 32 == 0
            and (dtype != torch.float32 or rows.dtype == torch.bfloat16)
            and all(w.is_contiguous() and w.dtype == dtype for w in weights))


def _dense_mma(*args, **kwargs):
    from .dense_mma import dense_mma_linear  # Gluon, imported on the GPU path only
    return dense_mma_linear(*args, **kwargs)


def _fp32_weight_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A decode-sized linear on an fp32 weight with true fp32 products: on the tensor cores (dense_mma.py) for bf16
    rows when switched on (mma_choice), else on the CUDA cores (fp32_rows.py)."""
    if _dense_on_tensor_cores(rows, weight):
        return _dense_mma(rows, weight)
    return fp32_rows_linear(rows, weight)


def _quantized(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: int, n: int, k: int,
               fp8_dot: bool | None) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if weight.stride(-1) != 1 or scale.element_size() != 1:
        raise ValueError("the weight must be contiguous along K and the scales E8M0 (float8_e8m0fnu or uint8 bytes)")
    rows = _rows(x, k)
    if fp8_dot is None and rows.shape[0] > DECODE_MAX_ROWS:
        dense = dequantize_weight(weight, scale, fmt, n, k)
        qdq = fp8_act_qdq(rows, torch.bfloat16)
        if x.dtype == torch.bfloat16:
            out = torch.nn.functional.linear(qdq, dense)
        else:
            out = torch.nn.functional.linear(qdq.float(), dense.float()).to(x.dtype)
        return out.view(*x.shape[:-1], n)
    if fp8_dot is None and fmt == FMT_FP8_TILE and _on_tensor_cores(rows, weight):
        out = _mma_linear(rows, weight, scale, x.dtype)
    elif fp8_dot is None and rows.shape[0] <= ROWS_MAX_ROWS and fmt == FMT_FP8_TILE:
        out = rows_linear(rows, weight, scale, fmt, n, k, x.dtype, quantize=True)
    elif fp8_dot:
        q, xs = fp8_act_quant(rows)
        out = run_linear(q, xs, weight, scale, fmt, n, k, x.dtype, torch.float8_e4m3fn)
    else:
        out = run_linear(fp8_act_qdq(rows, torch.bfloat16), None, weight, scale, fmt, n, k, x.dtype, torch.bfloat16)
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
    E8M0 scale [N, K/32]; the nibbles are dequantized in registers (W4A16; fp8_dot=True: e4m3, W4A8)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return _quantized(x, packed, scale, FMT_FP4_ROW, n, k, fp8_dot)


def fp8_row_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp8_dot: bool | None = None
                   ) -> torch.Tensor:
    """fp4_linear for a weight re-encoded at load by quant.fp4_to_fp8_weight: e4m3 [N, K], E8M0 scale [N, K/32]."""
    n, k = weight.shape
    return _quantized(x, weight, scale, FMT_FP8_ROW, n, k, fp8_dot)


def linear_pair(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor | None],
                second: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_linear or dense_linear of x by the first weight, the same by the second) with one activation QDQ and one
    launch for decode-sized calls: two FP8 weights (scales given) or two bf16/fp16 weights (scales None) of the
    same K. Each output is the one-weight call's math; only the split of K (from both weights' rows) differs."""
    (w1, s1), (w2, s2) = first, second
    k = w1.shape[1]
    quantized = s1 is not None
    if w2.shape[1] != k or (s2 is not None) != quantized or w2.dtype != w1.dtype:
        raise ValueError("linear_pair takes two FP8 weights with scales or two dense weights of one dtype and K")
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weights expect {k}")
    rows = _rows(x, k)
    if rows.shape[0] > DECODE_MAX_ROWS or w1.stride(-1) != 1 or w2.stride(-1) != 1 or (
            not quantized and w1.dtype not in (torch.bfloat16, torch.float16)):
        one = (lambda w, s: fp8_linear(x, w, s)) if quantized else (lambda w, s: dense_linear(x, w))
        return one(w1, s1), one(w2, s2)
    n1, n2 = w1.shape[0], w2.shape[0]
    if quantized and _on_tensor_cores(rows, w1, w2):
        out1, out2 = _mma_linear(rows, w1, s1, x.dtype, second=(w2, s2))
    elif not quantized and _dense_on_tensor_cores(rows, w1, w2):
        out1, out2 = _dense_mma(rows.to(w1.dtype), w1, second=w2)
    elif rows.shape[0] <= ROWS_MAX_ROWS:
        fmt, operand, out_dtype = (FMT_FP8_TILE, rows, x.dtype) if quantized else \
            (FMT_DENSE, rows.to(w1.dtype), w1.dtype)
        out1, out2 = rows_linear(operand, w1, s1, fmt, n1, k, out_dtype, second=(w2, s2, n2), quantize=quantized)
    elif quantized:
        out1, out2 = run_linear(fp8_act_qdq(rows, torch.bfloat16), None, w1, s1, FMT_FP8_TILE, n1, k, x.dtype,
                                torch.bfloat16, second=(w2, s2, n2))
    else:
        out1, out2 = run_linear(rows.to(w1.dtype), None, w1, None, FMT_DENSE, n1, k, w1.dtype, w1.dtype,
                                second=(w2, None, n2))
    return out1.view(*x.shape[:-1], n1), out2.view(*x.shape[:-1], n2)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact bf16 [N, K] of an FP8 weight e4m3 [N, K] with E8M0 scales per 32x32 tile."""
    n, k = weight.shape
    return dequantize_weight(weight, scale, FMT_FP8_TILE, n, k)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact bf16 [N, K] of a packed e2m1 weight [N, K/2] with E8M0 scales per (row, 32)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return dequantize_weight(packed, scale, FMT_FP4_ROW, n, k)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), weight.float()) for bf16/fp16/fp32 x and weight (the router's logits), without the
    fp32 copies at decode sizes: the fp32 weights' kernel converts both in registers (the same products and
    order as on fp32 copies)."""
    k = weight.shape[1]
    rows = _rows(x, k)
    if rows.shape[0] > DECODE_MAX_ROWS or weight.stride(-1) != 1:
        out = torch.nn.functional.linear(rows.float(), weight.float())
    else:
        out = _fp32_weight_linear(rows, weight)
    return out.view(*x.shape[:-1], weight.shape[0])


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x.to(weight.dtype), weight) for a bf16/fp16/fp32 weight [N, K], batch invariant up to
    DECODE_MAX_ROWS rows (cuBLAS picks its kernel by M). fp32 weights use true fp32 products (no TF32)."""
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dense_linear takes a bf16, fp16 or fp32 weight, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows = _rows(x, k)
    if rows.shape[0] > DECODE_MAX_ROWS:  # prefill-sized: cuBLAS
        out = torch.nn.functional.linear(rows.to(weight.dtype), weight)
    elif weight.dtype == torch.float32:  # true fp32 products, each weight read once
        out = _fp32_weight_linear(rows, weight)
    elif _dense_on_tensor_cores(rows, weight):
        out = _dense_mma(rows.to(weight.dtype), weight)
    elif rows.shape[0] <= ROWS_MAX_ROWS:
        out = rows_linear(rows.to(weight.dtype), weight, None, FMT_DENSE, n, k, weight.dtype)
    else:
        out = run_linear(rows, None, weight, None, FMT_DENSE, n, k, weight.dtype, weight.dtype)
    return out.view(*x.shape[:-1], n)
