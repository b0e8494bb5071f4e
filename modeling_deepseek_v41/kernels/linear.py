"""The ops of the linear layers and RMSNorm, with the reference's numerics: the quantized linear (weights as the
checkpoint stores them: FP8 e4m3, packed FP4 or dense), the grouped block-diagonal linear of the attention's
`wo_a`, the row-count-invariant linear they run on, and RMSNorm. Each op chooses the Triton kernel on CUDA
inference itself (`dispatch.kernel_path`); the modules holding the weights are in `layers/linear.py`.

Row invariance: CPU GEMM kernels for fp32 and float64 handle a row count that is not a multiple of 4 with another
summation order, so a token could get a last-bit-different result alone (decode) or with others (prefill,
verification). Padding the rows to a multiple of 4 gives every token the same kernel path.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .dispatch import kernel_path
from .gpu_linear import (dense_kernel_applies, gpu_fp32_linear, gpu_linear, gpu_linear_input_grad, gpu_linear_pair,
                         grouped_linear, triton_kernels)
from .numerics import WEIGHT_BLOCK, compute_dtype, dequantize_fp4_weight, dequantize_fp8_weight, fp8_act_qdq

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


def compute_dtype_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row_invariant_linear of x and the weight both in x's compute dtype (fp32, or float64 for float64): the
    router's logits. On the kernel path the fp32 kernel takes bf16/fp16 tensors as they are (no copies)."""
    acc = compute_dtype(x)
    if kernel_path(x) and acc == torch.float32 and dense_kernel_applies(weight):
        return gpu_fp32_linear(x, weight)
    return row_invariant_linear(x.to(acc), weight.to(acc))


def dequantize_stored(weight: torch.Tensor, scale: torch.Tensor | None, storage: str, dtype: torch.dtype
                      ) -> torch.Tensor:
    """A stored weight as a dense matrix of `dtype` (exact for FP8/FP4: values times power-of-two scales)."""
    if storage == STORAGE_FP8:
        return dequantize_fp8_weight(weight, scale, dtype)
    if storage == STORAGE_FP4:
        return dequantize_fp4_weight(weight, scale, dtype)
    return weight.to(dtype)


def quantized_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
    """The reference's block-scaled GEMM: FP8 activation QDQ, then fp32 matmul of the exactly dequantized weight."""
    dense = dequantize_stored(weight, scale, storage, torch.float32)
    q = fp8_act_qdq(x)
    return row_invariant_linear(q.float(), dense).to(q.dtype)


def quantized_forward(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
    """The quantized linear without autograd: the Triton kernels on CUDA, the exact emulation elsewhere."""
    if kernel_path(x):
        return gpu_linear(x, storage, weight, scale)
    return quantized_linear_reference(x, weight, scale, storage)


class QuantizedLinearFunction(torch.autograd.Function):
    """The quantized linear with a backward for the input only: the input gradient goes through the dequantized
    weight (straight through the activation QDQ) and the frozen FP8/FP4 weight gets none. Only the stored weight is
    kept for backward (no fp32 copy), so adapters train at the shipped precision. On CUDA both directions run on the
    kernels (forward and backward run without grad, which `kernel_path` asks for); elsewhere, the exact emulation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.storage = storage
        return quantized_forward(x, weight, scale, storage)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, scale = ctx.saved_tensors
        if kernel_path(grad_out):
            return gpu_linear_input_grad(grad_out, ctx.storage, weight, scale), None, None, None
        grad_x = grad_out.float() @ dequantize_stored(weight, scale, ctx.storage, torch.float32)
        return grad_x.to(grad_out.dtype), None, None, None


def stored_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, storage: str) -> torch.Tensor:
    """y = x W^T for a weight as stored. Dense: x cast to the weight's dtype, row-invariant. FP8/FP4: the
    reference's block-scaled GEMM, with an input-only backward when x records gradients (the weight is frozen)."""
    if storage == STORAGE_DENSE:
        return row_invariant_linear(x.to(weight.dtype), weight)
    if torch.is_grad_enabled() and x.requires_grad:
        return QuantizedLinearFunction.apply(x, weight, scale, storage)
    with torch.no_grad():  # frozen weights and an input without gradient: nothing to record
        return quantized_forward(x, weight, scale, storage)


def block_diagonal_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, storage: str
                          ) -> torch.Tensor:
    """x [..., G, in/G] times each of the G groups' rows of the weight [out, in/G] (block-diagonal, as the
    attention's wo_a), exactly in x's dtype and without activation QDQ: [..., G, out/G]. On CUDA inference the
    grouped kernel dequantizes FP8 tiles in registers (no whole-weight copy; batch invariant for decode)."""
    groups = x.shape[-2]
    rows = weight.shape[0] // groups  # the weight as held (a tensor-parallel rank holds its groups)
    if kernel_path(x) and x.dtype in (torch.bfloat16, torch.float32) and (rows % WEIGHT_BLOCK == 0
                                                                         or storage == STORAGE_DENSE):
        return grouped_linear(x, weight, scale, groups)
    dense = dequantize_stored(weight, scale, storage, x.dtype)
    return torch.einsum("...gd,grd->...gr", x, dense.view(groups, rows, -1))


def pairs_in_one_launch(x: torch.Tensor, storage: str, dtype: torch.dtype) -> bool:
    """Whether two stored linears of one input run as one launch (stored_linear_pair): CUDA inference, FP8 weights
    or dense bf16/fp16 ones; nothing records gradients."""
    return (kernel_path(x) and not torch.is_grad_enabled()
            and (storage == STORAGE_FP8 or (storage == STORAGE_DENSE and dtype in (torch.bfloat16, torch.float16))))


def stored_linear_pair(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor | None],
                       second: tuple[torch.Tensor, torch.Tensor | None], storage: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored_linear of x by the first (weight, scale), the same by the second): one activation QDQ and one launch
    where pairs_in_one_launch says so, two stored_linear calls otherwise (the same numbers up to the split of K)."""
    if pairs_in_one_launch(x, storage, first[0].dtype) and first[0].dtype == second[0].dtype:
        return gpu_linear_pair(x, first, second)
    return stored_linear(x, *first, storage), stored_linear(x, *second, storage)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose weight multiplies the fp32 normalized value (HF's usual order casts first: not bit-equal)."""
    if kernel_path(x):
        return triton_kernels().rms_norm(x, weight, eps)
    h = x.to(compute_dtype(x))
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)
