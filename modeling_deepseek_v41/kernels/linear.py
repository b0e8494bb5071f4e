"""The layers whose numerics are the reference's: the quantized linear (weights as the checkpoint stores them:
FP8 e4m3, packed FP4 or dense), the row-count-invariant linear it runs on, and RMSNorm.

Row invariance: CPU GEMM kernels for fp32 and float64 handle a row count that is not a multiple of 4 with another
summation order, so a token could get a last-bit-different result alone (decode) or with others (prefill,
verification). Padding the rows to a multiple of 4 gives every token the same kernel path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .dispatch import kernel_path
from .gpu_linear import dense_kernel_applies, gpu_linear
from .numerics import (
    WEIGHT_BLOCK, compute_dtype, dequantize_fp4_weight, dequantize_fp8_weight, fp8_act_qdq, weight_dtype,
)

STORAGE_FP8 = "fp8"
STORAGE_FP4 = "fp4"
STORAGE_DENSE = "dense"
_ROW_MULTIPLE = 4


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), padded to a multiple of 4 rows for fp32/float64 so results are row-count invariant
    (on CUDA: the batch-invariant dense kernel)."""
    if kernel_path(x) and dense_kernel_applies(weight):
        return gpu_linear(x, STORAGE_DENSE, weight, None)
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


class DeepseekV41Linear(nn.Module):
    """y = x W^T with the reference's dispatch on the weight's storage.

    - fp8: weight e4m3 [out, in] plus `scale` E8M0 [ceil(out/32), ceil(in/32)].
    - fp4: weight packed e2m1 [out, in/2] (int8, as the checkpoint stores it) plus `scale` E8M0 [out, in/32].
    - dense: a plain weight of `dtype`; the input is cast to that dtype (fp32 weights run fp32 linears).

    Quantized weights take the FP8 activation QDQ (per-token groups of 32, power-of-two scales) and multiply
    the exactly dequantized operands in fp32, which reproduces the reference's block-scaled GEMM.
    """

    def __init__(self, in_features: int, out_features: int, storage: str = STORAGE_DENSE,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.storage = storage
        if storage == STORAGE_FP8:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(-(-out_features // WEIGHT_BLOCK), -(-in_features // WEIGHT_BLOCK),
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        elif storage == STORAGE_FP4:
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // WEIGHT_BLOCK,
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        elif storage == STORAGE_DENSE:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype(dtype)))
            self.register_parameter("scale", None)
        else:
            raise ValueError(f"unknown weight storage {storage!r}")

    @property
    def is_quantized(self) -> bool:
        return self.storage != STORAGE_DENSE

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense matrix (exact: FP8/FP4 values times power-of-two scales)."""
        if self.storage == STORAGE_FP8:
            return dequantize_fp8_weight(self.weight, self.scale, dtype)
        if self.storage == STORAGE_FP4:
            return dequantize_fp4_weight(self.weight, self.scale, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_path(x) and (self.is_quantized or dense_kernel_applies(self.weight)):
            return gpu_linear(x, self.storage, self.weight, self.scale)
        if not self.is_quantized:
            return row_invariant_linear(x.to(self.weight.dtype), self.weight)
        x = fp8_act_qdq(x)
        return row_invariant_linear(x.float(), self.dense_weight(torch.float32)).to(x.dtype)

    @torch.no_grad()
    def dequantize_(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Replace quantized storage by a dense weight of `dtype` (the bf16 weight mode)."""
        if not self.is_quantized:
            return
        dense = self.dense_weight(dtype)
        del self.weight, self.scale
        self.weight = nn.Parameter(dense)
        self.register_parameter("scale", None)
        self.storage = STORAGE_DENSE

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.storage}"


class DeepseekV41RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the fp32 normalized value (HF's usual order casts first: not bit-equal)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=weight_dtype(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
