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
from .gpu_linear import (dense_kernel_applies, gpu_linear, gpu_linear_input_grad, gpu_linear_pair, grouped_linear,
                         triton_kernels)
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


class DeepseekV41Weight(nn.Module):
    """A weight stored as the checkpoint stores it, with its exact dequantization.

    - fp8: weight e4m3 [out, in] plus `scale` E8M0 [ceil(out/32), ceil(in/32)].
    - fp4: weight packed e2m1 [out, in/2] (int8, as the checkpoint stores it) plus `scale` E8M0 [out, in/32].
    - dense: a plain weight of `dtype`.

    Used as such for the attention's grouped output projection `wo_a` (applied by an einsum on its weight, so not
    a linear layer: PEFT's "all-linear" leaves it out); `DeepseekV41Linear` adds the forward.
    """

    def __init__(self, in_features: int, out_features: int, storage: str = STORAGE_DENSE,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a dense weight and a bias
        self.in_features = in_features
        self.out_features = out_features
        self.storage = storage
        self.register_parameter("bias", None)
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
        return dequantize_stored(self.weight, self.scale, self.storage, dtype)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., G, in/G] times each of the G groups' rows of the weight [out, in/G] (block-diagonal, as the
        attention's wo_a), exactly in x's dtype and without activation QDQ: [..., G, out/G]. On CUDA inference
        the grouped kernel dequantizes FP8 tiles in registers (no whole-weight copy; batch invariant for decode)."""
        groups = x.shape[-2]
        rows = self.weight.shape[0] // groups  # the weight as held (a tensor-parallel rank holds its groups)
        if kernel_path(x) and x.dtype in (torch.bfloat16, torch.float32) and (rows % WEIGHT_BLOCK == 0
                                                                             or not self.is_quantized):
            return grouped_linear(x, self.weight, self.scale, groups)
        return torch.einsum("...gd,grd->...gr", x, self.dense_weight(x.dtype).view(groups, rows, -1))

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


class DeepseekV41Linear(DeepseekV41Weight, nn.Linear):
    """y = x W^T with the reference's dispatch on the weight's storage (see `DeepseekV41Weight`).

    Dense weights: the input is cast to the weight's dtype (fp32 weights run fp32 linears). Quantized weights take
    the FP8 activation QDQ (per-token groups of 32, power-of-two scales) and multiply the exactly dequantized
    operands in fp32, which reproduces the reference's block-scaled GEMM.

    A `torch.nn.Linear` (without bias) in every storage, so PEFT and transformers treat it as a linear layer: LoRA
    wraps it by PEFT's own dispatch, `target_modules="all-linear"` finds it. Quantized weights are frozen (their
    backward gives the input gradient only); training them is refused with the two ways out.
    """

    def reset_parameters(self) -> None:
        """Initialisation is the model's `_init_weights` (it knows the storage formats)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype adapters attached to this layer use (PEFT reads it): fp32 beside FP8/FP4 weights."""
        return torch.float32 if self.is_quantized else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_quantized:
            return row_invariant_linear(x.to(self.weight.dtype), self.weight)
        if torch.is_grad_enabled():
            if self.training and (self.weight.requires_grad or self.scale.requires_grad):
                raise ValueError(
                    "The FP8/FP4 weights of a quantized DeepSeek-V4.1 model cannot be trained. Either attach adapters "
                    "(e.g. peft.get_peft_model(model, LoraConfig(target_modules=...))), which freezes these weights "
                    "and trains on them as shipped, or load with weight_mode=\"bf16\" for full fine-tuning.")
            if x.requires_grad:
                return QuantizedLinearFunction.apply(x, self.weight, self.scale, self.storage)
        with torch.no_grad():  # frozen weights and an input without gradient: nothing to record
            return quantized_forward(x, self.weight, self.scale, self.storage)


def linear_pair(x: torch.Tensor, first: nn.Module, second: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for two linears that read the same input (the query and KV down-projections, the
    shared expert's gate and up): on CUDA inference one activation QDQ and one launch when both are frozen
    DeepseekV41Linears of the same storage (FP8, or dense bf16/fp16); otherwise each module's own forward, so an
    adapter wrapping either, training and the CPU's exact path are untouched."""
    fusable = (type(first) is DeepseekV41Linear and type(second) is DeepseekV41Linear and not torch.is_grad_enabled()
               and kernel_path(x) and first.storage == second.storage and first.weight.dtype == second.weight.dtype
               and (first.storage == STORAGE_FP8
                    or (first.storage == STORAGE_DENSE and first.weight.dtype in (torch.bfloat16, torch.float16))))
    if not fusable:
        return first(x), second(x)
    return gpu_linear_pair(x, (first.weight, first.scale), (second.weight, second.scale))


class DeepseekV41RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the fp32 normalized value (HF's usual order casts first: not bit-equal)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=weight_dtype(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_path(x):
            return triton_kernels().rms_norm(x, self.weight, self.eps)
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)
