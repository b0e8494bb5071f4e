"""CSA2 attention of decode-sized chunks straight from the cache's packed storage, in two launches per layer.

Per query row: RoPE on the queries, the window listed from the layer's FP8 ring (oldest first) and the selected
rows of the FP4 pool (in selection order) dequantized in registers; phase 1 computes every block of 64 entries'
logits for all heads at once (each entry dequantized once), phase 2 runs the reference's online softmax over the
blocks in order (probabilities rounded to bf16 against the running max in the numerator, fp32 in the denominator,
the sink added at the end) per group of heads and output dims, and the inverse RoPE. That is
`kernels.sparse_attention.attend_stored`'s exact path, computed with tensor-core dots (every entry value is exact
in bf16, so only the fp32 summation order differs). Prefill-sized calls dequantize the ring and pool once into one
table and list each row's entries as its rows in a third, small launch, so both phases gather without masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import cast, e2m1_value, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs


@dataclass(frozen=True)
class Tiles:
    """One regime's launch shapes."""
    logit_entries: int  # phase 1: entries per program (a divisor of BLOCK_ENTRIES)
    qk_chunk: int  # phase 1: head dims per logit dot
    logit_warps: int
    block_heads: int  # phase 2: heads per program
    out_chunk: int  # phase 2: output dims per program
    output_warps: int


BLOCK_ENTRIES = 64  # the reference kernel's softmax block
LOGIT_HEADS = 64  # phase 1: heads per program, so each entry is dequantized once per row for them all
# Every regime's logit dots take the same chunks of head dims (qk_chunk) and phase 2's the same 64-entry blocks:
# the tiles differ only in how many heads, entries and output dims a program takes, never in a sum's order, so a
# row's result does not depend on the call's row count (batch invariance; tested bit for bit on the GPU).
# decode (H200, one row at 4K: 61.7 -> 37.4 us for a pair of layers): a row's ten blocks of entries split over 40
# programs, phase 2 in narrow slices of output dims
DECODE_TILES = Tiles(logit_entries=16, qk_chunk=128, logit_warps=8, block_heads=16, out_chunk=32, output_warps=4)
# decode calls of a batch's rows fill the SMs without those splits, which only add work there (batch 32: 588 ->
# 643 tok/s)
WIDE_DECODE_ROWS = 16
WIDE_DECODE_TILES = Tiles(logit_entries=64, qk_chunk=128, logit_warps=8, block_heads=16, out_chunk=64, output_warps=4)
# prefill-sized calls: phase 2 with every head and 256 output dims per program, so each block of entries is read
# once per row and half the dims (H200, a pair of a 4K prefill's layers: 11.9 ms at 64 dims, 7.6 at 256 with
# phase 1 in 4 warps)
PREFILL_MIN_ROWS = 64
PREFILL_TILES = Tiles(logit_entries=64, qk_chunk=128, logit_warps=4, block_heads=64, out_chunk=256, output_warps=8)
# prefill-sized calls read the ring and pool as tables dequantized once per call (the same values, so the same
# result bit for bit), not each entry per query (H200, 16K exact prefill: 3,256 -> 2,851 ms)
PREFILL_TABLES = True
LOGITS_BYTES = 1 << 28  # the most a launch's logits take (a long prefill runs its rows in slices)
TABLE_ROWS, TABLE_DIMS = 32, 128  # stored rows and dims per program of the tables' dequantization
# rows are a grid's second axis (limit 65,535), so a row's programs run next to each other and share its q and logits
MAX_GRID_ROWS = 65535


@triton.jit
def _rope_chunk(x, rot_ptr, row, c0, D: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                ACC: tl.constexpr):
    """x [BH, DC] (dims c0 .. c0+DC of each head, in ACC) with its pairs in the last ROPE dims rotated by the row's
    unit complex rotations (fp32 (cos, sin) pairs at rot_ptr); other pairs pass unchanged."""
    BH: tl.constexpr = x.shape[0]
    DC: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [BH, DC // 2, 2]))
    pair = (c0 - (D - ROPE)) // 2 + tl.arange(0, DC // 2)
    in_rope = pair >= 0
    pair = tl.where(in_rope, pair, 0)
    cos = tl.load(rot_ptr + row * ROPE + 2 * pair, mask=in_rope, other=1.0).to(ACC)[None, :]
    sin = tl.load(rot_ptr + row * ROPE + 2 * pair + 1, mask=in_rope, other=0.0).to(ACC)[None, :]
    if INVERSE:
        sin = -sin
    rotated_even = tl.where(in_rope[None, :], even * cos - odd * sin, even)
    rotated_odd = tl.where(in_rope[None, :], even * sin + odd * cos, odd)
    return rotated_even, rotated_odd


@triton.jit
def _query_chunk(q_ptr, rot_ptr, r, heads, h_ok, H, c0, D: tl.constexpr, ROPE: tl.constexpr, DC: tl.constexpr,
                 ACC: tl.constexpr, DOT: tl.constexpr):
    """Dims c0 .. c0+DC of the row's queries [BH, DC] after RoPE, rounded to q's dtype as the reference's are."""
    q = tl.load(q_ptr + (r * H + heads)[:, None] * D + c0 + tl.arange(0, DC)[None, :], mask=h_ok[:, None],
                other=0.0)
    if c0 + DC > D - ROPE:  # only the chunks that RoPE rotates are rounded again
        even, odd = _rope_chunk(q.to(ACC), rot_ptr, r, c0, D, ROPE, False, ACC)
        q = cast(tl.reshape(tl.join(even, odd), [q.shape[0], DC]), q_ptr.dtype.element_ty)
    return q.to(DOT)


@triton.jit
def _window_chunk(codes_ptr, scales_ptr, slot, valid, c0, D: tl.constexpr, DC: tl.constexpr, DOT: tl.constexpr):
    """Dims c0 .. c0+DC of ring slots `slot` [BL]: e4m3 values times their E8M0 scales (zero where not valid)."""
    codes = tl.load(codes_ptr + slot[:, None] * D + c0 + tl.arange(0, DC)[None, :], mask=valid[:, None], other=0)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    byte = tl.load(scales_ptr + slot[:, None] * (D // 32) + c0 // 32 + tl.arange(0, DC // 32)[None, :],
                   mask=valid[:, None], other=127).to(tl.int32)
    scale = (byte << 23).to(tl.float32, bitcast=True)  # E8M0 2^(byte-127); byte 0 never holds a window scale
    values = tl.reshape(tl.reshape(values, [slot.shape[0], DC // 32, 32]) * scale[:, :, None], [slot.shape[0], DC])
    return tl.where(valid[:, None], values, 0.0).to(DOT)


@triton.jit
def _pool_chunk(codes_ptr, scales_ptr, row, valid, c0, D: tl.constexpr, DC: tl.constexpr, DOT: tl.constexpr):
    """Dims c0 .. c0+DC of pool rows `row` [BL]: e2m1 pairs (even element low) times their e4m3 scales per 16."""
    byte = tl.load(codes_ptr + row[:, None] * (D // 2) + c0 // 2 + tl.arange(0, DC // 2)[None, :],
                   mask=valid[:, None], other=0).to(tl.int32)
    values = tl.reshape(tl.join(e2m1_value(byte & 15), e2m1_value((byte >> 4) & 15)), [row.shape[0], DC])
    scale = tl.load(scales_ptr + row[:, None] * (D // 16) + c0 // 16 + tl.arange(0, DC // 16)[None, :],
                    mask=valid[:, None], other=0)
    scale = scale.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    values = tl.reshape(tl.reshape(values, [row.shape[0], DC // 16, 16]) * scale[:, :, None], [row.shape[0], DC])
    return tl.where(valid[:, None], values, 0.0).to(DOT)


@triton.jit
def _table_kernel(table_ptr, codes_ptr, scales_ptr, first, count, stride_tb, stride_cb, stride_sb, D: tl.constexpr,
                  BR: tl.constexpr, DC: tl.constexpr, POOL: tl.constexpr, DOT: tl.constexpr):
    """Table rows first .. first+count of one batch row: its ring's slots (POOL: its pool's rows) 0 .. count-1
    dequantized, BR rows and DC dims per program."""
    wait_for_inputs()
    b = tl.program_id(2).to(tl.int64)
    index = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = index < count
    c0 = tl.program_id(1) * DC
    if POOL:
        values = _pool_chunk(codes_ptr + b * stride_cb, scales_ptr + b * stride_sb, index, ok, c0, D, DC, DOT)
    else:
        values = _window_chunk(codes_ptr + b * stride_cb, scales_ptr + b * stride_sb, index, ok, c0, D, DC, DOT)
    tl.store(table_ptr + b * stride_tb + (first + index)[:, None] * D + c0 + tl.arange(0, DC)[None, :], values,
             mask=ok[:, None])


def _dequantized_table(ring, pool, dim: int, dtype: torch.dtype, dot) -> torch.Tensor:
    """[B, 1 + ring slots + pool rows, dim]: a zero row, the ring's slots and the pool's rows (None: no pool)
    dequantized (exact in `dtype`), one launch per source."""
    batch, slots = ring.codes.shape[:2]
    rows = pool.codes.shape[1] if pool is not None else 0
    table = torch.empty(batch, 1 + slots + rows, dim, dtype=dtype, device=ring.codes.device)
    table[:, 0].zero_()
    dc = min(TABLE_DIMS, dim)
    for source, first, count, is_pool in ((ring, 1, slots, False), (pool, 1 + slots, rows, True)):
        if count:
            _table_kernel[(triton.cdiv(count, TABLE_ROWS), dim // dc, batch)](
                table, source.codes, source.scales, first, count, table.stride(0), source.codes.stride(0),
                source.scales.stride(0), D=dim, BR=TABLE_ROWS, DC=dc, POOL=is_pool, DOT=dot, **launch_options())
    return table


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _query_row(r, S, pos_ptr, floor_ptr, window, HAS_FLOOR: tl.constexpr):
    """(batch row, position, first listed window position, lowest visible position) of query row r."""
    b = r // S
    p = tl.load(pos_ptr + r)
    lowest = tl.maximum(p - window + 1, 0)
    lowest_visible = lowest * 0
    if HAS_FLOOR:
        lowest_visible = tl.load(floor_ptr + b)
    return b, p, lowest, lowest_visible


@triton.jit
def _block_entries(j, lane, r, b, p, lowest, lowest_visible, width, ring_size, n_topk, ring_pos_ptr, topk_ptr,
                   stride_rpb, stride_tr, BL: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Entries `lane` (of 0 .. BL-1) of block j of the row's entry list in the reference's order (its softmax
    blocks of BL entries): `width` window entries first, oldest first, from the ring (an empty or overwritten slot
    holds another position), then the selected pool rows in selection order (-1: none); a block may hold both.
    Returns (ring slot, window entry valid, pool row, pool entry valid), each shaped like lane; each source keeps
    its own mask (Triton 3.6 fails on one mask shared by the ring's and the pool's loads)."""
    k = j * BL + lane
    listed = lowest + k
    slot = listed % ring_size
    window_ok = (k < width) & (listed <= p)  # listed >= 0: a padded query lists nothing
    if HAS_FLOOR:
        window_ok = window_ok & (listed >= lowest_visible)
    window_ok = window_ok & (tl.load(ring_pos_ptr + b * stride_rpb + slot, mask=window_ok, other=-1) == listed)
    pick = tl.load(topk_ptr + r * stride_tr + (k - width), mask=(k >= width) & (k - width < n_topk), other=-1)
    pool_ok = (k >= width) & (pick >= 0)
    return slot, window_ok, tl.where(pool_ok, pick, 0), pool_ok


@triton.jit
def _entry_list_kernel(entries_ptr, pos_ptr, floor_ptr, ring_pos_ptr, topk_ptr, S, window, width, ring_size, n_topk,
                       n_blocks, stride_rpb, stride_tr, row0, BL: tl.constexpr, HAS_FLOOR: tl.constexpr):
    """Prefill: block j of row r's entries (rows row0 onward) as rows of its batch row's dequantized table (a zero
    row for none, the ring's slots from 1, the pool's rows from 1 + ring_size), so that both phases gather each
    block with unmasked loads."""
    wait_for_inputs()
    r = row0 + tl.program_id(1).to(tl.int64)
    j = tl.program_id(0)
    lane = tl.arange(0, BL)
    b, p, lowest, lowest_visible = _query_row(r, S, pos_ptr, floor_ptr, window, HAS_FLOOR)
    slot, window_ok, row, pool_ok = _block_entries(j, lane, r, b, p, lowest, lowest_visible, width, ring_size,
                                                   n_topk, ring_pos_ptr, topk_ptr, stride_rpb, stride_tr, BL,
                                                   HAS_FLOOR)
    entry = tl.where(window_ok, 1 + slot, tl.where(pool_ok, 1 + ring_size + row, 0))
    tl.store(entries_ptr + ((r - row0) * n_blocks + j) * BL + lane, entry.to(tl.int32))


@triton.jit
def _listed(entries_ptr, r, row0, j, lane, n_blocks, BL: tl.constexpr):
    """Table rows of entries `lane` of block j of row r (0: none), from the entry list of rows row0 onward."""
    return tl.load(entries_ptr + ((r - row0) * n_blocks + j) * BL + lane)


@triton.jit
def _table_chunk(table_ptr, entry, c0, D: tl.constexpr, DC: tl.constexpr, DOT: tl.constexpr):
    """Dims c0 .. c0+DC of the dequantized table's rows `entry` [BL] (row 0 is zeros)."""
    return tl.load(table_ptr + entry[:, None] * D + c0 + tl.arange(0, DC)[None, :]).to(DOT)


@triton.jit
def _entry_chunk(j, width, slot, window_ok, row, pool_ok, ring_codes, ring_scales, pool_codes, pool_scales, c0,
                 D: tl.constexpr, BL: tl.constexpr, DC: tl.constexpr, DOT: tl.constexpr):
    """Dims c0 .. c0+DC of block j's entries [BL, DC] (zero where not valid), from the ring, the pool or both."""
    if (j + 1) * BL <= width:
        e = _window_chunk(ring_codes, ring_scales, slot, window_ok, c0, D, DC, DOT)
    elif j * BL >= width:
        e = _pool_chunk(pool_codes, pool_scales, row, pool_ok, c0, D, DC, DOT)
    else:  # the block where the window ends and the pool rows begin (invalid entries are zero in both)
        e = _window_chunk(ring_codes, ring_scales, slot, window_ok, c0, D, DC, DOT) + \
            _pool_chunk(pool_codes, pool_scales, row, pool_ok, c0, D, DC, DOT)
    return e


@triton.jit
def _attention_logits_kernel(q_ptr, rot_ptr, logits_ptr, pos_ptr, floor_ptr, ring_codes_ptr, ring_scales_ptr,
                             ring_pos_ptr, pool_codes_ptr, pool_scales_ptr, topk_ptr, entries_ptr, S, H, window, width,
                             ring_size, n_topk, n_blocks, softmax_scale, stride_rcb, stride_rsb, stride_rpb, stride_pcb,
                             stride_psb, stride_tr, row0, D: tl.constexpr, ROPE: tl.constexpr, BH: tl.constexpr,
                             BL: tl.constexpr, LE: tl.constexpr, DC: tl.constexpr, HAS_FLOOR: tl.constexpr,
                             ACC: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, TABLES: tl.constexpr):
    """Phase 1: LE entries of block j of row r's entries dequantized once, their masked, scaled logits for BH heads
    (every dim); the logits of rows row0 onward. TABLES: the entries from the entry list and the dequantized table
    at ring_codes_ptr."""
    wait_for_inputs()
    r = row0 + tl.program_id(1).to(tl.int64)  # (r * H + head) * D passes 2^31 past 65,536 rows
    j = tl.program_id(0) // (BL // LE)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    h_ok = heads < H
    b, p, lowest, lowest_visible = _query_row(r, S, pos_ptr, floor_ptr, window, HAS_FLOOR)
    lane = tl.program_id(0) % (BL // LE) * LE + tl.arange(0, LE)
    if TABLES:
        entry = _listed(entries_ptr, r, row0, j, lane, n_blocks, BL)
        valid = entry > 0
    else:
        slot, window_ok, row, pool_ok = _block_entries(j, lane, r, b, p, lowest, lowest_visible, width, ring_size,
                                                       n_topk, ring_pos_ptr, topk_ptr, stride_rpb, stride_tr, BL,
                                                       HAS_FLOOR)
        valid = window_ok | pool_ok
    logits = tl.full([BH, LE], 0.0, ACC)
    for c0 in tl.static_range(0, D, DC):
        q = _query_chunk(q_ptr, rot_ptr, r, heads, h_ok, H, c0, D, ROPE, DC, ACC, DOT)
        if TABLES:
            e = _table_chunk(ring_codes_ptr + b * stride_rcb, entry, c0, D, DC, DOT)
        else:
            e = _entry_chunk(j, width, slot, window_ok, row, pool_ok, ring_codes_ptr + b * stride_rcb,
                             ring_scales_ptr + b * stride_rsb, pool_codes_ptr + b * stride_pcb,
                             pool_scales_ptr + b * stride_psb, c0, D, BL, DC, DOT)
        logits += _dot(q, tl.trans(e), IEEE)
    logits = tl.where(valid[None, :], logits, -float("inf")) * softmax_scale
    tl.store(logits_ptr + (((r - row0) * H + heads) * n_blocks + j)[:, None] * BL + lane[None, :], logits,
             mask=h_ok[:, None])


@triton.jit
def _attention_output_kernel(rot_ptr, logits_ptr, o_ptr, sink_ptr, pos_ptr, floor_ptr, ring_codes_ptr,
                             ring_scales_ptr, ring_pos_ptr, pool_codes_ptr, pool_scales_ptr, topk_ptr, entries_ptr, S,
                             H, window, width, ring_size, n_topk, n_blocks, stride_rcb, stride_rsb, stride_rpb,
                             stride_pcb, stride_psb, stride_tr, row0, D: tl.constexpr, ROPE: tl.constexpr,
                             BH: tl.constexpr, BL: tl.constexpr, DO: tl.constexpr, HAS_FLOOR: tl.constexpr,
                             ROUND_P: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                             TABLES: tl.constexpr):
    """Phase 2: the reference's online softmax over the blocks in order (probabilities rounded to bf16 against the
    running max in the numerator, fp32 in the denominator, the sink at the end) for BH heads and DO output dims,
    then the inverse RoPE. TABLES: the entries as in phase 1."""
    wait_for_inputs()
    r = row0 + tl.program_id(1).to(tl.int64)  # (r * H + head) * D passes 2^31 past 65,536 rows
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    h_ok = heads < H
    o0 = tl.program_id(0) * DO
    b, p, lowest, lowest_visible = _query_row(r, S, pos_ptr, floor_ptr, window, HAS_FLOOR)
    lane = tl.arange(0, BL)
    m = tl.full([BH], -1e30, ACC)
    den = tl.full([BH], 0.0, ACC)
    acc = tl.full([BH, DO], 0.0, ACC)
    for j in range(0, n_blocks):
        logits = tl.load(logits_ptr + (((r - row0) * H + heads) * n_blocks + j)[:, None] * BL + lane[None, :],
                         mask=h_ok[:, None], other=-float("inf"))
        if TABLES:
            e = _table_chunk(ring_codes_ptr + b * stride_rcb, _listed(entries_ptr, r, row0, j, lane, n_blocks, BL),
                             o0, D, DO, DOT)
        else:
            slot, window_ok, row, pool_ok = _block_entries(j, lane, r, b, p, lowest, lowest_visible, width,
                                                           ring_size, n_topk, ring_pos_ptr, topk_ptr, stride_rpb,
                                                           stride_tr, BL, HAS_FLOOR)
            e = _entry_chunk(j, width, slot, window_ok, row, pool_ok, ring_codes_ptr + b * stride_rcb,
                             ring_scales_ptr + b * stride_rsb, pool_codes_ptr + b * stride_pcb,
                             pool_scales_ptr + b * stride_psb, o0, D, BL, DO, DOT)
        m_new = tl.maximum(m, reduce_max(logits, 1))
        rescale = tl.exp(m - m_new)
        probs = tl.exp(logits - m_new[:, None])
        den = den * rescale + reduce_sum(probs, 1)
        if ROUND_P:
            probs = cast(probs, tl.bfloat16).to(tl.float32)
        acc = acc * rescale[:, None] + _dot(probs.to(e.dtype), e, IEEE)
        m = m_new
    # a query with nothing to attend to outputs zeros (its sink term is kept finite)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(ACC)
    den = den + tl.exp(tl.where(m <= -1e30, 0.0, sink - m))
    out_dtype: tl.constexpr = o_ptr.dtype.element_ty
    o = cast(acc / den[:, None], out_dtype).to(ACC)
    if o0 + DO > D - ROPE:
        even, odd = _rope_chunk(o, rot_ptr, r, o0, D, ROPE, True, ACC)
        o = tl.reshape(tl.join(cast(even, out_dtype).to(ACC), cast(odd, out_dtype).to(ACC)), [BH, DO])
    tl.store(o_ptr + (r * H + heads)[:, None] * D + o0 + tl.arange(0, DO)[None, :], cast(o, out_dtype),
             mask=h_ok[:, None])


def stored_attention(q: torch.Tensor, rotation: torch.Tensor, rope_dim: int, positions: torch.Tensor, floor,
                     window: int, ring, pool, selected: torch.Tensor | None, sink: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """The launch behind `sparse_attention.attend_stored` (its arguments; ring and pool its StoredWindow and
    StoredPool, contiguous per row)."""
    batch, seq, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    rot = torch.view_as_real(rotation.to(torch.complex64)).reshape(batch * seq, rope_dim).contiguous()
    pos = positions.reshape(-1).contiguous()
    has_pool = selected is not None
    topk = selected.reshape(batch * seq, -1).contiguous() if has_pool else pos
    pool_codes, pool_scales = (pool.codes, pool.scales) if has_pool else (ring.codes, ring.scales)
    for t, width in ((ring.codes, dim), (ring.scales, dim // 32), (pool_codes, dim // 2 if has_pool else dim),
                     (pool_scales, dim // 16 if has_pool else dim // 32)):
        if t.stride(2) != 1 or t.stride(1) != width:
            raise ValueError("the ring and pool rows must be contiguous within each batch row")
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    dot = tl.float64 if q.dtype == torch.float64 else tl.float32 if q.device.type == "cpu" else tl.bfloat16
    n_blocks = triton.cdiv(ring.width + (topk.shape[1] if has_pool else 0), BLOCK_ENTRIES)
    rows = batch * seq
    # a long prefill's rows in slices, so that the logits buffer stays within LOGITS_BYTES
    per_launch = max(1, min(rows, MAX_GRID_ROWS, LOGITS_BYTES // (heads * max(n_blocks, 1) * BLOCK_ENTRIES * 4)))
    logits = torch.empty(per_launch, heads, max(n_blocks, 1) * BLOCK_ENTRIES, dtype=torch.float32
                         if acc == tl.float32 else torch.float64, device=q.device)
    floor_arg = pos if floor is None else floor.contiguous()
    prefill = rows >= PREFILL_MIN_ROWS
    tiles = PREFILL_TILES if prefill else WIDE_DECODE_TILES if rows >= WIDE_DECODE_ROWS else DECODE_TILES
    dc, do = min(tiles.qk_chunk, dim), min(tiles.out_chunk, dim)
    ring_codes, ring_scales = ring.codes, ring.scales
    tables = prefill and PREFILL_TABLES
    entries = pos
    if tables:  # every stored row dequantized once (exact in DOT), not per query and head group
        table_dtype = {tl.float64: torch.float64, tl.float32: torch.float32, tl.bfloat16: torch.bfloat16}[dot]
        table = _dequantized_table(ring, pool if has_pool else None, dim, table_dtype, dot)
        ring_codes = ring_scales = pool_codes = pool_scales = table
        entries = torch.empty(per_launch, n_blocks * BLOCK_ENTRIES, dtype=torch.int32, device=q.device)
    storage = (ring_codes, ring_scales, ring.positions, pool_codes, pool_scales, topk, entries)
    shapes = (seq, heads, window, ring.width, ring.codes.shape[1], topk.shape[1] if has_pool else 0, n_blocks)
    strides = (ring_codes.stride(0), ring_scales.stride(0), ring.positions.stride(0), pool_codes.stride(0),
               pool_scales.stride(0), topk.stride(0))
    common = dict(D=dim, ROPE=rope_dim, BL=BLOCK_ENTRIES, HAS_FLOOR=floor is not None, ACC=acc, DOT=dot,
                  IEEE=dot != tl.bfloat16, TABLES=tables)
    for row0 in range(0, rows, per_launch):
        count = min(per_launch, rows - row0)
        if tables and n_blocks:
            _entry_list_kernel[(n_blocks, count)](
                entries, pos, floor_arg, ring.positions, topk, seq, window, ring.width, ring.codes.shape[1],
                shapes[5], n_blocks, ring.positions.stride(0), topk.stride(0), row0, BL=BLOCK_ENTRIES,
                HAS_FLOOR=floor is not None, **launch_options())
        if n_blocks:
            grid = (n_blocks * (BLOCK_ENTRIES // tiles.logit_entries), count, triton.cdiv(heads, LOGIT_HEADS))
            _attention_logits_kernel[grid](
                q, rot, logits, pos, floor_arg, *storage, *shapes, softmax_scale, *strides, row0, BH=LOGIT_HEADS,
                LE=tiles.logit_entries, DC=dc, num_warps=tiles.logit_warps, **common, **launch_options())
        _attention_output_kernel[(dim // do, count, triton.cdiv(heads, tiles.block_heads))](
            rot, logits, out, sink, pos, floor_arg, *storage, *shapes, *strides, row0, BH=tiles.block_heads, DO=do,
            ROUND_P=q.dtype == torch.bfloat16, num_warps=tiles.output_warps, **common, **launch_options())
    return out
