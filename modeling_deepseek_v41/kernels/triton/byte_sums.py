"""Weighted byte sums of many tensors in one launch: per tensor, sums[c] = sum_i byte[c * chunk + i] *
coefficient[i] for each whole chunk of its bytes, then one sum of the remainder.

The portable formulation widens every byte to float64 before a matrix-vector product (eight bytes written and read
per byte hashed) and launches per tensor; here each program reads one chunk's bytes once, from a table of the
tensors' addresses, and accumulates the products in int64, which is exact, so the result equals that formulation's
(every partial sum is an integer below 2^53). One launch for a model's thousands of parameters.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .common import reduce_sum
from .launch import launch_options, wait_for_inputs

BLOCK_BYTES = 4096
BYTE_SUMS_WARPS = 4


@triton.jit
def _byte_sums_kernel(address_ptr, length_ptr, first_ptr, coefficient_ptr, out_ptr, n_tensors,
                      SEARCH_STEPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program = output slot: the tensor t with first[t] <= slot < first[t + 1] (binary search), then the weighted
    sum of its chunk slot - first[t] (the last one may be partial or empty)."""
    wait_for_inputs()
    slot = tl.program_id(0)
    lo = slot * 0
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(first_ptr + mid) <= slot
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    data = tl.load(address_ptr + lo).to(tl.pointer_type(tl.uint8))
    n_bytes = tl.load(length_ptr + lo)
    start = (slot - tl.load(first_ptr + lo)).to(tl.int64) * CHUNK
    total = tl.full([BLOCK], 0, tl.int64)
    for i0 in tl.static_range(0, CHUNK, BLOCK):
        lane = i0 + tl.arange(0, BLOCK)
        byte = tl.load(data + start + lane, mask=start + lane < n_bytes, other=0).to(tl.int32)
        weight = tl.load(coefficient_ptr + lane).to(tl.int32)
        total += (byte * weight).to(tl.int64)  # < 255 * 2^20, exact in int32
    tl.store(out_ptr + slot, reduce_sum(total, 0).to(tl.float64))


def byte_sums(tensors: list[torch.Tensor], coefficients: torch.Tensor) -> torch.Tensor:
    """float64: for each contiguous tensor in turn, taken as its bytes, one sum per whole chunk and one for the
    remainder (0 when empty), chunk = coefficients' length (integers below 2^20); all tensors on coefficients'
    device. Reads only their addresses and sizes on the host (no op per tensor)."""
    chunk = coefficients.numel()
    if chunk % BLOCK_BYTES:
        raise ValueError(f"byte_sums needs a chunk that is a multiple of {BLOCK_BYTES} bytes, got {chunk}")
    device = coefficients.device
    lengths = [t.numel() * t.element_size() for t in tensors]
    first = [0]
    for n in lengths:
        first.append(first[-1] + n // chunk + 1)
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(device)
    lengths = torch.tensor(lengths, dtype=torch.int64).to(device)
    first_slots = torch.tensor(first, dtype=torch.int64).to(device)
    out = torch.empty(first[-1], dtype=torch.float64, device=device)
    # Triton launches on the current device, which may hold other weights (the interpreter's tensors are the CPU's)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _byte_sums_kernel[(first[-1],)](addresses, lengths, first_slots, coefficients.to(torch.int32), out,
                                        len(tensors), SEARCH_STEPS=max(1, len(tensors).bit_length()), CHUNK=chunk,
                                        BLOCK=BLOCK_BYTES, num_warps=BYTE_SUMS_WARPS, **launch_options())
    return out
