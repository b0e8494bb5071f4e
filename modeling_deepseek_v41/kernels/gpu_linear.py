"""The layers' entry points into the Triton kernels (kernels/triton/), for CUDA inference (`dispatch.kernel_path`).
triton is imported on the first call, so a CPU-only machine never imports it."""

from __future__ import annotations

import torch


def triton_kernels():
    """The kernels package (imports triton)."""
    from . import triton as kernels
    return kernels


def gpu_linear(x: torch.Tensor, storage: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """kernels.linear.stored_linear through the kernels: FP8 block-scaled, packed FP4, or dense (bf16/fp16/fp32
    weights; batch invariant up to the kernels' decode row count, cuBLAS above)."""
    kernels = triton_kernels()
    if storage == "fp8":
        return kernels.fp8_linear(x, weight, scale)
    if storage == "fp4":
        return kernels.fp4_linear(x, weight, scale)
    return kernels.dense_linear(x.to(weight.dtype), weight)


def gpu_fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with both taken exactly as fp32 (bf16/fp16/fp32 tensors), without converting copies."""
    return triton_kernels().fp32_linear(x, weight)


def gpu_linear_pair(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor | None],
                    second: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two linears of one input (FP8 weights with scales, or dense bf16 ones) in one launch for decode sizes."""
    return triton_kernels().linear_pair(x, first, second)


def gpu_linear_input_grad(grad_out: torch.Tensor, storage: str, weight: torch.Tensor, scale: torch.Tensor
                          ) -> torch.Tensor:
    """grad_out [..., N] times an FP8/FP4 weight [N, K]: the input gradient of a frozen quantized linear. The weight
    is dequantized exactly to a transient bf16 copy by a kernel, then one tensor-core GEMM (fp32 accumulation;
    true fp32 products for fp32 gradients)."""
    kernels = triton_kernels()
    dense = (kernels.fp8_dequantize if storage == "fp8" else kernels.fp4_dequantize)(weight, scale)
    if grad_out.dtype == torch.bfloat16:
        return grad_out @ dense
    return (grad_out.float() @ dense.float()).to(grad_out.dtype)


def dense_kernel_applies(weight: torch.Tensor) -> bool:
    """Dense weights the kernels take (others, e.g. float64, keep torch's linear)."""
    return weight.dtype in (torch.bfloat16, torch.float16, torch.float32)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, groups: int) -> torch.Tensor:
    """x [..., G, D] times each group's rows of a weight [G*R, D] (FP8 with scales, or dense), exactly in x's
    dtype, without activation QDQ: the attention's block-diagonal wo_a."""
    return triton_kernels().grouped_linear(x, weight, scale, groups)


def grouped_moe(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, stacks: tuple, limit: float,
                shared: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' sum [T, D] in fp32 from the stacked expert weights (w1, s1, w3, s3, w2, s2); with
    `shared`, plus the shared expert's output in its dtype (in the same launch as the sum)."""
    return triton_kernels().grouped_moe(tokens, experts, weights, *stacks, limit, shared=shared)
