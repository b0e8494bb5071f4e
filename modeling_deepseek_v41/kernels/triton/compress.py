"""The compressor's pooling of a fixed-shape chunk (a decode step) in one launch: program (b, g) forms group g of
batch row b from the tokens at its r positions (or, for the first group, the carried ones), the per-channel softmax
over their gate scores weighting their kv projections; the last program per row writes the open group as the new
carry. kernels.compress.pool_groups's math: slot by slot in group order, a token before a carried entry."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compress import fixed_group_count
from .common import cast, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs


@triton.jit
def _slot(kv_ptr, score_ptr, carry_kv_ptr, carry_score_ptr, b, row_positions, target, j, from_carry, S,
          stride_t, stride_c, HD: tl.constexpr, ACC: tl.constexpr):
    """(kv [HD], score [HD], filled) of the slot holding position `target`: the chunk's token there, else (the
    first group, from_carry) carry slot j, else empty (0, -inf)."""
    s = tl.arange(0, row_positions.shape[0])
    match = (row_positions == target) & (s < S)
    found = reduce_max(match.to(tl.int32), 0) > 0
    token = reduce_sum(tl.where(match, s, 0), 0)
    d = tl.arange(0, HD)
    carried = from_carry & (found == 0)
    from_token = d < tl.where(found, HD, 0)  # the scalar conditions as [HD] masks
    from_carried = d < tl.where(carried, HD, 0)
    kv = tl.load(kv_ptr + b * stride_t + token * HD + d, mask=from_token, other=0.0)
    score = tl.load(score_ptr + b * stride_t + token * HD + d, mask=from_token, other=-float("inf"))
    kv = tl.where(from_carried, tl.load(carry_kv_ptr + b * stride_c + j * HD + d, mask=from_carried, other=0.0), kv)
    score = tl.where(from_carried, tl.load(carry_score_ptr + b * stride_c + j * HD + d, mask=from_carried,
                                           other=-float("inf")), score)
    first_score = reduce_max(tl.where(d == 0, score, -float("inf")), 0)  # the torch path's test of a carried slot
    return kv.to(ACC), score.to(ACC), found | (carried & (first_score > -float("inf")))


@triton.jit
def _pool_groups_kernel(kv_ptr, score_ptr, pos_ptr, carry_kv_ptr, carry_score_ptr, latents_ptr, rows_ptr,
                        new_kv_ptr, new_score_ptr, S, G, stride_t, stride_c, has_carry, R: tl.constexpr,
                        HD: tl.constexpr, SP: tl.constexpr, ACC: tl.constexpr):
    """Program (b, g): g < G writes latent row g and its pool row; g == G writes the carry."""
    wait_for_inputs()
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    s = tl.arange(0, SP)
    row_positions = tl.load(pos_ptr + b * S + s, mask=s < S, other=-1)
    live = row_positions >= 0
    last = reduce_max(tl.where(live, row_positions, -1), 0)
    has_live = last >= 0
    first = -reduce_max(tl.where(live, -row_positions, -last), 0)
    base = tl.where(has_live, first // R, 0)
    if g < G:
        group, use_carry = (base + g) * R, (g == 0) & (has_carry != 0)
        top = tl.full([HD], -float("inf"), ACC)
        complete = has_live
        for j in tl.static_range(R):  # the group's maximum score per channel, and whether every slot is there
            kv, score, filled = _slot(kv_ptr, score_ptr, carry_kv_ptr, carry_score_ptr, b, row_positions,
                                      group + j, j, use_carry, S, stride_t, stride_c, HD, ACC)
            top = tl.maximum(top, score)
            complete = complete & filled
        shift = tl.where(top > -float("inf"), top, 0.0)  # an empty group: exp(-inf) everywhere, no inf - inf
        total = tl.full([HD], 0.0, ACC)
        for j in tl.static_range(R):
            kv, score, filled = _slot(kv_ptr, score_ptr, carry_kv_ptr, carry_score_ptr, b, row_positions,
                                      group + j, j, use_carry, S, stride_t, stride_c, HD, ACC)
            total += tl.exp(score - shift)
        total = tl.where(top > -float("inf"), total, 1.0)  # an empty group (zeroed below) divides nothing by 0
        latent = tl.full([HD], 0.0, ACC)
        for j in tl.static_range(R):
            kv, score, filled = _slot(kv_ptr, score_ptr, carry_kv_ptr, carry_score_ptr, b, row_positions,
                                      group + j, j, use_carry, S, stride_t, stride_c, HD, ACC)
            latent += kv * (tl.exp(score - shift) / total)
        d = tl.arange(0, HD)
        tl.store(latents_ptr + (b * G + g) * HD + d, cast(tl.where(complete, latent, 0.0),
                                                          latents_ptr.dtype.element_ty))
        tl.store(rows_ptr + b * G + g, tl.where(complete, base + g, -1))
    else:
        open_group = tl.minimum(tl.maximum(tl.where(has_live, (last + 1) // R - base, 0), 0), G)
        d = tl.arange(0, HD)
        for j in tl.static_range(R):
            kv, score, filled = _slot(kv_ptr, score_ptr, carry_kv_ptr, carry_score_ptr, b, row_positions,
                                      (base + open_group) * R + j, j, (open_group == 0) & (has_carry != 0), S, stride_t,
                                      stride_c, HD, ACC)
            tl.store(new_kv_ptr + (b * R + j) * HD + d, kv)
            tl.store(new_score_ptr + (b * R + j) * HD + d, score)


def pool_groups(kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                carry: tuple[torch.Tensor, torch.Tensor] | None, ratio: int, dtype: torch.dtype):
    """kernels.compress.pool_groups with fixed shapes: kv, score [B,S,hd] (hd a power of two), positions [B,S],
    carry [B,r,hd] or None -> (latents [B,G,hd] in dtype, pool rows [B,G], the new carry)."""
    batch, seq, hd = kv.shape
    groups = fixed_group_count(seq, ratio)
    kv, score, positions = kv.contiguous(), score.contiguous(), positions.contiguous()
    carry_kv, carry_score = (t.contiguous() for t in carry) if carry is not None else (kv, score)
    latents = torch.empty(batch, groups, hd, dtype=dtype, device=kv.device)
    rows = torch.empty(batch, groups, dtype=positions.dtype, device=kv.device)
    new_kv = torch.empty(batch, ratio, hd, dtype=kv.dtype, device=kv.device)
    new_score = torch.empty_like(new_kv)
    _pool_groups_kernel[(batch, groups + 1)](
        kv, score, positions, carry_kv, carry_score, latents, rows, new_kv, new_score, seq, groups, kv.stride(0),
        carry_kv.stride(0), int(carry is not None), R=ratio, HD=hd, SP=max(2, triton.next_power_of_2(seq)),
        ACC=tl.float64 if kv.dtype == torch.float64 else tl.float32, num_warps=4, **launch_options())
    return latents, rows, (new_kv, new_score)
