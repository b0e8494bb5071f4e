"""Weighted sums of tensors' bytes per fixed-size chunk (the op behind the prefix cache's weights digest)."""

from __future__ import annotations

import torch

from .gpu_linear import triton_kernels

BLOCK_ROWS = 256  # chunks widened to float64 at once on the portable path


def weighted_byte_sums(tensors: list[torch.Tensor], coefficients: torch.Tensor) -> torch.Tensor:
    """For each contiguous tensor in turn, taken as its bytes: sums[c] = sum_i byte[c * n + i] * coefficients[i]
    (n = coefficients' length) per whole chunk, then one sum of the remainder (0 when empty); all concatenated,
    float64. With integer coefficients below 2^20 and chunks of at most 2^14 bytes every partial sum is an integer
    below 2^53, so the result is exact on any device and in any summation order. On CUDA one launch reads each byte
    once."""
    if coefficients.is_cuda:
        return triton_kernels().byte_sums(tensors, coefficients)
    chunk = coefficients.numel()
    weights = coefficients.to(torch.float64)
    sums = []
    for tensor in tensors:
        data = tensor.detach().reshape(-1).view(torch.uint8)
        whole = data.numel() - data.numel() % chunk
        rows = data[:whole].view(-1, chunk)
        sums += [rows[start:start + BLOCK_ROWS].to(torch.float64) @ weights
                 for start in range(0, rows.shape[0], BLOCK_ROWS)]
        tail = data[whole:]
        sums.append((tail.to(torch.float64) @ weights[: tail.numel()]).reshape(1))
    return torch.cat(sums)
