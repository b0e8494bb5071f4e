"""The modules that hold weights as the checkpoint stores them (FP8 e4m3, packed FP4 or dense) and RMSNorm's weight;
their forwards call the ops of `kernels/linear.py`, which hold the reference's numerics and pick the kernels."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear import (
    STORAGE_DENSE, STORAGE_FP4, STORAGE_FP8, block_diagonal_linear, dequantize_stored, rms_norm, stored_linear,
    stored_linear_pair,
)
from ..kernels.numerics import WEIGHT_BLOCK, weight_dtype


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
        """x [..., G, in/G] times each of the G groups' rows of the weight (block-diagonal, as the attention's
        wo_a), exactly in x's dtype and without activation QDQ: [..., G, out/G]."""
        return block_diagonal_linear(x, self.weight, self.scale, self.storage)

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
        if (self.is_quantized and torch.is_grad_enabled() and self.training
                and (self.weight.requires_grad or self.scale.requires_grad)):
            raise ValueError(
                "The FP8/FP4 weights of a quantized DeepSeek-V4.1 model cannot be trained. Either attach adapters "
                "(e.g. peft.get_peft_model(model, LoraConfig(target_modules=...))), which freezes these weights "
                "and trains on them as shipped, or load with weight_mode=\"bf16\" for full fine-tuning.")
        return stored_linear(x, self.weight, self.scale, self.storage)


class DeepseekV41RMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the fp32 normalized value (HF's usual order casts first: not bit-equal)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=weight_dtype(dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear_pair(x: torch.Tensor, first: nn.Module, second: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)) for two linears that read the same input (the query and KV down-projections, the
    shared expert's gate and up): one op for two plain DeepseekV41Linears of one storage (one launch on CUDA
    inference); any other module (an adapter wrapping either, a hooked or offloaded linear) is called as it is."""
    if (_plain(first) and _plain(second) and first.storage == second.storage
            and not (first.training and torch.is_grad_enabled())):
        return stored_linear_pair(x, (first.weight, first.scale), (second.weight, second.scale), first.storage)
    return first(x), second(x)


def _plain(module: nn.Module) -> bool:
    """A DeepseekV41Linear whose call nothing wraps: no adapter around it, no accelerate hook replacing its forward
    (offloaded weights arrive only through it), no forward hooks."""
    return (type(module) is DeepseekV41Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks)
