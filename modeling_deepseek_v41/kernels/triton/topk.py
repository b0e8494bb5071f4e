"""The indexer's top-k selections without sorting: a radix select of each row's k-th largest score, then one pass
that writes the chosen positions in ascending order.

torch's stable sort of a score row (then of the chosen positions) is two to four sort kernels per selecting layer
(about 390 us of a 4K-context decode step on an H200). Here one program per row finds the k-th largest score's
32-bit key a byte at a time (masked 256-bin histograms over the row: two rounds for bf16 scores), then keeps every
position above it and, of the positions holding it, the earliest ones: the set torch.sort(descending, stable) puts
first, written in position order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import prefix_sum, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs

_NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # _ordered_key(-inf)
_NAN_KEY = tl.constexpr(0xFFFFFFFF)
_MAX_BLOCK = 4096
_KEY_BYTES = {torch.bfloat16: 2, torch.float16: 3}


@triton.jit
def _ordered_key(x):
    """fp32 values -> uint32 keys in the values' order; -0.0 ties +0.0 and every NaN sorts above +inf, as in
    torch.sort."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _row_keys(s_ptr, start, N, key_mask, BLOCK: tl.constexpr):
    idx = start + tl.arange(0, BLOCK)
    ok = idx < N
    return idx, ok, _ordered_key(tl.load(s_ptr + idx, mask=ok, other=0.0).to(tl.float32)) & key_mask


@triton.jit
def _topk_ascending_kernel(s_ptr, out_ptr, N, K, stride_s, stride_o, BLOCK: tl.constexpr, DROP: tl.constexpr,
                           KEY_BYTES: tl.constexpr):
    """out[row, :K] = the positions of row's K largest scores (ties to the earlier position), ascending; DROP:
    positions scoring -inf (or NaN) are left out and the row is padded with -1. KEY_BYTES: the keys' bytes
    that tell the scores apart (2 for bf16, whose keys carry them in their top 16 bits; 3 for fp16)."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    s_ptr += row * stride_s
    out_ptr += row * stride_o
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, tl.uint32)  # the k-th largest key's bytes found so far
    known = tl.full([], 0, tl.uint32)
    need = K  # how many of the keys matching `prefix` still belong to the top K
    key_mask = tl.full([], 0xFFFFFFFF, tl.uint32) << (32 - 8 * KEY_BYTES)
    for r in tl.static_range(KEY_BYTES):
        shift = 24 - 8 * r
        hist = tl.full([256], 0, tl.int32)
        for start in range(0, N, BLOCK):
            idx, ok, key = _row_keys(s_ptr, start, N, key_mask, BLOCK)
            match = ok & ((key & known) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = reduce_sum(hist, 0) - prefix_sum(hist, 0) + hist  # matching keys with this byte or a larger one
        byte = reduce_max(tl.where(at_least >= need, bins, 0), 0)
        need -= reduce_sum(tl.where(bins > byte, hist, 0), 0)
        prefix |= byte.to(tl.uint32) << shift
        known |= tl.full([], 255, tl.uint32) << shift
    taken = 0
    ties = 0
    for start in range(0, N, BLOCK):
        idx, ok, key = _row_keys(s_ptr, start, N, key_mask, BLOCK)
        tie = (ok & (key == prefix)).to(tl.int32)
        first_ties = (ties + prefix_sum(tie, 0) - tie) < need
        chosen = (ok & (key > prefix)) | ((tie != 0) & first_ties)
        if DROP:
            chosen &= (key > (_NEG_INF_KEY & key_mask)) & (key != (_NAN_KEY & key_mask))
        pick = chosen.to(tl.int32)
        tl.store(out_ptr + taken + prefix_sum(pick, 0) - pick, idx.to(tl.int64), mask=chosen)
        taken += reduce_sum(pick, 0)
        ties += reduce_sum(tie, 0)
    if DROP:
        for start in range(0, K, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + slot, tl.full([BLOCK], -1, tl.int64), mask=(slot >= taken) & (slot < K))


def topk_ascending(scores: torch.Tensor, k: int, drop_unreachable: bool) -> torch.Tensor:
    """[..., k] int64 positions of the k largest scores along the last dim (0 < k <= its width; ties to the
    earlier position), ascending; drop_unreachable: those scoring -inf become -1, after the others."""
    width = scores.shape[-1]
    if not 0 < k <= width:
        raise ValueError(f"topk_ascending needs 0 < k <= {width} (the scores' last dim), got k={k}")
    rows = scores.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.long, device=scores.device)
    if rows.shape[0]:
        block = min(max(triton.next_power_of_2(width), 256), _MAX_BLOCK)
        _topk_ascending_kernel[(rows.shape[0],)](rows, out, width, k, rows.stride(0), out.stride(0), BLOCK=block,
                                                 DROP=drop_unreachable, KEY_BYTES=_KEY_BYTES.get(scores.dtype, 4),
                                                 num_warps=8 if block >= 2048 else 4, **launch_options())
    return out.view(*scores.shape[:-1], k)
