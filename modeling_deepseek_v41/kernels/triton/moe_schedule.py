"""The MoE routing schedule (expert_blocks) in one Triton launch, plus each token's slots in expert order.

expert_blocks costs ~25 small torch kernels per layer and decode step (sort, searchsorted, cumsum, casts...);
expert_schedule computes the same tensors bit for bit in one launch whose shapes follow from the input's, so it
can be captured in a CUDA graph. Every program counts the experts' pairs (a histogram of all ids, cheap at decode
sizes), then does its own tile of each job: sorted rows of some pairs, row ranges of some blocks, slot orders
of some tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import prefix_sum, reduce_sum
from .launch import launch_options, wait_for_inputs

PAIR_TILE = 64  # pairs ranked per program: a [64, 64] compare of their ids
BLOCK_TILE = 16  # blocks per program: a [16, bins] compare against the experts' block ends
HIST_TILE = 2048  # ids counted per histogram step
ORDER_TILE = 4096  # elements of a program's [tokens, k, k] compare of slots


@triton.jit
def _histograms(ids_ptr, pairs, before, BINS: tl.constexpr, HT: tl.constexpr):
    """[BINS] pairs of each expert: all of them, and those before pair `before`. Lanes that count nothing go to
    bin BINS - 1, which no expert has (Triton's interpreter has counted out-of-range values in the last bin)."""
    total = tl.full([BINS], 0, tl.int32)
    prefix = tl.full([BINS], 0, tl.int32)
    for p0 in range(0, pairs, HT):
        i = p0 + tl.arange(0, HT)
        ids = tl.load(ids_ptr + i, mask=i < pairs, other=BINS - 1).to(tl.int32)
        total += tl.histogram(ids, BINS)
        prefix += tl.histogram(tl.where(i < before, ids, BINS - 1), BINS)
    return total, prefix


@triton.jit
def _sorted_rows(ids_ptr, pair_ptr, pairs, p0, first_free, BINS: tl.constexpr, PT: tl.constexpr, SUBS: tl.constexpr):
    """pair_of_row[rank(i)] = i for pairs i in [p0, p0 + SUBS * PT), rank(i) = #{id_j < id_i} + #{j < i: id_j = id_i}:
    the stable sort. first_free[e]: expert e's first row not taken by the pairs before p0."""
    for q in range(SUBS):
        i = p0 + q * PT + tl.arange(0, PT)
        live = i < pairs
        ids = tl.load(ids_ptr + i, mask=live, other=BINS - 1).to(tl.int32)
        earlier = (ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])
        rank = tl.gather(first_free, ids, 0) + reduce_sum(earlier.to(tl.int32), 1)
        tl.store(pair_ptr + rank, i, mask=live)
        first_free += tl.histogram(ids, BINS)


@triton.jit
def _blocks(expert_ptr, start_ptr, end_ptr, capacity, b0, counts, offsets, n_experts,
            BLOCK_ROWS: tl.constexpr, BT: tl.constexpr):
    """Expert, first and end sorted row of blocks [b0, b0 + BT): each expert's rows in blocks of BLOCK_ROWS."""
    n_blocks = (counts + BLOCK_ROWS - 1) // BLOCK_ROWS
    block_end = prefix_sum(n_blocks, 0)
    b = b0 + tl.arange(0, BT)
    # searchsorted(block_end, b, right=True); blocks past the last are all experts' (>= E), clamped like expert_blocks
    expert = tl.minimum(reduce_sum((block_end[None, :] <= b[:, None]).to(tl.int32), 1), n_experts - 1)
    start = tl.gather(offsets, expert, 0) + (b - tl.gather(block_end - n_blocks, expert, 0)) * BLOCK_ROWS
    end = tl.minimum(tl.gather(offsets + counts, expert, 0), start + BLOCK_ROWS)
    real = b < reduce_sum(n_blocks, 0)
    live = b < capacity
    tl.store(expert_ptr + b, expert, mask=live)
    tl.store(start_ptr + b, tl.where(real, start, 0), mask=live)
    tl.store(end_ptr + b, tl.where(real, end, 0), mask=live)


@triton.jit
def _slot_order(ids_ptr, order_ptr, tokens, t0, K: tl.constexpr, TT: tl.constexpr, KP: tl.constexpr):
    """order[t] = token t's slots by (expert id, slot), for tokens [t0, t0 + TT): argsort(stable=True)."""
    t = t0 + tl.arange(0, TT)
    s = tl.arange(0, KP)
    live = (t < tokens)[:, None] & (s < K)[None, :]
    key = tl.load(ids_ptr + t[:, None] * K + s[None, :], mask=live, other=0).to(tl.int32) * KP + s[None, :]
    # a slot's place: how many live slots of its token have a smaller (id, slot)
    smaller = (key[:, None, :] < key[:, :, None]) & live[:, None, :]
    place = reduce_sum(smaller.to(tl.int32), 2)
    tl.store(order_ptr + t[:, None] * K + place, s[None, :], mask=live)


@triton.jit
def _schedule_kernel(ids_ptr, pair_ptr, expert_ptr, start_ptr, end_ptr, order_ptr, tokens, n_experts, capacity,
                     K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BINS: tl.constexpr, HT: tl.constexpr,
                     PT: tl.constexpr, SUBS: tl.constexpr, BT: tl.constexpr, TT: tl.constexpr, KP: tl.constexpr):
    wait_for_inputs()
    g = tl.program_id(0)
    pairs = tokens * K
    total, prefix = _histograms(ids_ptr, pairs, g * SUBS * PT, BINS, HT)
    counts = tl.where(tl.arange(0, BINS) < n_experts, total, 0)
    offsets = prefix_sum(counts, 0) - counts  # first sorted row of each expert
    _sorted_rows(ids_ptr, pair_ptr, pairs, g * SUBS * PT, offsets + prefix, BINS, PT, SUBS)
    _blocks(expert_ptr, start_ptr, end_ptr, capacity, g * BT, counts, offsets, n_experts, BLOCK_ROWS, BT)
    _slot_order(ids_ptr, order_ptr, tokens, g * TT, K, TT, KP)


def _sub_tiles(pairs: int) -> int:
    """Pair tiles ranked per program: one up to 8192 pairs (decode: most parallel); past that up to 8, since every
    program counts all ids and more programs cost more than they save (measured on an H200)."""
    return min(8, triton.next_power_of_2(triton.cdiv(max(pairs, 1), 8192)))


def expert_schedule(experts: torch.Tensor, n_experts: int, block_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair_of_row, block_expert, block_start, block_end, order), all int32 on experts' device.

    The first four equal expert_blocks(experts, n_experts, block_rows), padding blocks included;
    order = experts.argsort(dim=-1, stable=True). experts [T, k] int32/int64 ids in [0, n_experts). One launch,
    no host read."""
    tokens, k = experts.shape
    pairs = tokens * k
    capacity = min(n_experts, pairs) + triton.cdiv(pairs, block_rows)
    device = experts.device
    pair_of_row = torch.empty(pairs, dtype=torch.int32, device=device)
    block_expert, block_start, block_end = (torch.empty(capacity, dtype=torch.int32, device=device) for _ in range(3))
    order = torch.empty(tokens, k, dtype=torch.int32, device=device)
    reach = triton.next_power_of_2(max(pairs, 1))
    pt, ht = min(PAIR_TILE, reach), min(HIST_TILE, reach)
    kp = triton.next_power_of_2(k)
    tt = max(1, min(ORDER_TILE // (kp * kp), triton.next_power_of_2(max(tokens, 1))))
    subs = _sub_tiles(pairs)
    grid = max(triton.cdiv(pairs, pt * subs), triton.cdiv(capacity, BLOCK_TILE), triton.cdiv(tokens, tt))
    if grid:  # no pairs, nothing to write
        _schedule_kernel[(grid,)](experts.contiguous(), pair_of_row, block_expert, block_start, block_end, order,
                                  tokens, n_experts, capacity, K=k, BLOCK_ROWS=block_rows,
                                  BINS=triton.next_power_of_2(n_experts + 1), HT=ht, PT=pt, SUBS=subs,
                                  BT=BLOCK_TILE, TT=tt, KP=kp, **launch_options())
    return pair_of_row, block_expert, block_start, block_end, order


ONE_LAUNCH_MAX_TOKENS = 4096  # past this the torch schedule is faster: every program counts all ids (H200)


def expert_blocks(experts: torch.Tensor, n_experts: int, block_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side schedule: (pair index of each sorted row, expert, first and end sorted row of each block).

    pair = token * k + slot. The block count is a bound from the shapes; blocks past the real count get an empty
    row range. All torch ops with device results: no host read, capturable."""
    ids = experts.reshape(-1)
    pairs = ids.numel()
    sorted_ids, pair_of_row = torch.sort(ids, stable=True)
    bounds = torch.arange(n_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds)  # first sorted row of each expert, and the end
    blocks = (offsets[1:] - offsets[:-1] + block_rows - 1) // block_rows
    block_end = torch.cumsum(blocks, 0)
    capacity = min(n_experts, pairs) + triton.cdiv(pairs, block_rows)
    b = torch.arange(capacity, device=ids.device, dtype=block_end.dtype)
    expert = torch.searchsorted(block_end, b, right=True).clamp_max(n_experts - 1)
    local = b - (block_end - blocks)[expert]
    start = offsets[expert] + local * block_rows
    end = torch.minimum(offsets[expert + 1], start + block_rows)
    valid = b < block_end[-1]
    start = torch.where(valid, start, 0)
    end = torch.where(valid, end, 0)
    return pair_of_row.to(torch.int32), expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def moe_schedule(experts: torch.Tensor, n_experts: int, block_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_schedule's five tensors: from its one launch up to ONE_LAUNCH_MAX_TOKENS tokens, from torch ops
    (expert_blocks and a stable argsort) above; the same values either way."""
    if experts.shape[0] <= ONE_LAUNCH_MAX_TOKENS:
        return expert_schedule(experts, n_experts, block_rows)
    order = experts.argsort(dim=-1, stable=True).to(torch.int32).contiguous()
    return (*expert_blocks(experts, n_experts, block_rows), order)
