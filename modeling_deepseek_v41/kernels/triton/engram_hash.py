"""Engram's n-gram hashing in one launch: a program per position reads its max_ngram tokens back through the
history (blocked at the start and at dead ids), then per layer and column the rolling xor of the tokens' products
with the layer's multipliers modulo the column's prime, plus its bucket offset. Integer math: the exact path's
bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, wait_for_inputs


@triton.jit
def _engram_rows_kernel(hist_ptr, pad_ptr, primes_ptr, offsets_ptr, mult_ptr, out_ptr, T, S, L, C,
                        N: tl.constexpr, HEADS: tl.constexpr, LP: tl.constexpr, CP: tl.constexpr):
    """Rows [L, C] of position s (of the last S) of batch row b."""
    wait_for_inputs()
    s = tl.program_id(0)  # positions on the grid's first axis: a long prompt's passes the others' 65,535
    b = tl.program_id(1).to(tl.int64)
    position = T - S + s
    layer = tl.arange(0, LP)[:, None]
    column = tl.arange(0, CP)[None, :]
    ok = (layer < L) & (column < C)
    grams = column // HEADS + 1  # the column's n-gram size minus one: tokens 0..grams are xor-ed
    pad = tl.load(pad_ptr)
    blocked = position < 0
    rolling = tl.full([LP, CP], 0, tl.int64)
    for shift in tl.static_range(N):
        source = tl.load(hist_ptr + b * T + tl.maximum(position - shift, 0))
        blocked = blocked | (position < shift) | (source == -1)
        token = tl.where(blocked, pad, source)
        product = token * tl.load(mult_ptr + layer * N + shift, mask=layer < L, other=0)
        if shift == 0:
            rolling = rolling + product
        else:
            rolling = tl.where(grams >= shift, rolling ^ product, rolling)
    prime = tl.load(primes_ptr + layer * C + column, mask=ok, other=1)
    rows = rolling % prime + tl.load(offsets_ptr + layer * C + column, mask=ok, other=0)
    tl.store(out_ptr + ((b * S + s) * L + layer) * C + column, rows, mask=ok)


def engram_rows(history: torch.Tensor, pad_id: torch.Tensor, max_ngram: int, width: int, primes: torch.Tensor,
                offsets: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """kernels.engram_hash.engram_rows's launch (int64 history, primes, offsets, multipliers)."""
    batch, total = history.shape
    layers, columns = offsets.shape
    heads = primes.shape[-1]
    out = torch.empty(batch, width, layers, columns, dtype=torch.int64, device=history.device)
    if batch and width and layers:
        _engram_rows_kernel[(width, batch)](
            history.contiguous(), pad_id.to(torch.int64).reshape(1), primes.contiguous(), offsets.contiguous(),
            multipliers.contiguous(), out, total, width, layers, columns, N=max_ngram, HEADS=heads,
            LP=triton.next_power_of_2(layers), CP=triton.next_power_of_2(columns), num_warps=1, **launch_options())
    return out
