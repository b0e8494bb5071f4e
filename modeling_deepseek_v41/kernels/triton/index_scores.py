"""The CSA2 indexer's scores in one launch: score[s, t] = sum_h relu(q[s,h] . k[t]) * w[s,h], only the scores
written.

The exact path materializes the per-head scores [S, H, N] and passes over them for the ReLU, the weights and the
sum over heads: at a 64K prompt that is hundreds of GB per layer. Here a program holds BT keys and walks the heads
for BS queries; blocks of keys no query of the block may see yet are skipped. The roundings are the exact path's:
each head's dot (fp32 sums) rounded to the scores' dtype, the weighted ReLU rounded again, the sum over heads in
fp32 rounded once. Keys come as values or as a cache stores them (FP4 pairs with an E8M0 scale per 32 values),
decoded in registers: exact, so the same scores without unpacking the pool first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, e2m1_value, e8m0_value, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs

BLOCK_QUERIES, BLOCK_KEYS = 64, 128
INDEX_WARPS = 8
CANDIDATE_KEYS, CANDIDATE_WARPS = 64, 4  # candidate slots per program of one query: 128 registers on sm_90
MIN_DOT_ROWS = 16  # a tensor-core dot's fewest rows: the heads of one query are padded to it


@triton.jit
def _keys(k_ptr, ks_ptr, rows, ok, HD: tl.constexpr, DTYPE: tl.constexpr, PACKED: tl.constexpr):
    """Index keys [R, HD] of rows `rows` (0 where not ok) in DTYPE: values [*, HD], or (PACKED) e2m1 pairs
    [*, HD/2] (the even element in the low nibble) times their E8M0 scales [*, HD/32], which is exact."""
    R: tl.constexpr = rows.shape[0]
    if PACKED:
        half = tl.arange(0, HD // 2)
        byte = tl.load(k_ptr + rows[:, None] * (HD // 2) + half[None, :], mask=ok[:, None], other=0).to(tl.int32)
        pairs = tl.reshape(tl.join(e2m1_value(byte & 15), e2m1_value(byte >> 4)), [R, HD])
        scale = e8m0_value(ks_ptr + rows[:, None] * (HD // 32) + tl.arange(0, HD // 32)[None, :], ok[:, None])
        keys = tl.reshape(tl.reshape(pairs, [R, HD // 32, 32]) * scale[:, :, None], [R, HD]).to(DTYPE)
    else:
        keys = tl.load(k_ptr + rows[:, None] * HD + tl.arange(0, HD)[None, :], mask=ok[:, None], other=0.0)
    return keys


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, vis_ptr, out_ptr, S, N, H, stride_qb, stride_qs, stride_wb,
                         stride_kb, stride_ksb, stride_vb, stride_ob, HD: tl.constexpr, BS: tl.constexpr,
                         BT: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, PACKED: tl.constexpr):
    """Scores of queries s0 .. s0+BS against keys t0 .. t0+BT of batch row b; -inf where t >= visible[s]."""
    wait_for_inputs()
    b = tl.program_id(2)
    s = tl.program_id(0) * BS + tl.arange(0, BS)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    s_ok, t_ok = s < S, t < N
    visible = tl.load(vis_ptr + b * stride_vb + s, mask=s_ok, other=0)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    dims = tl.arange(0, HD)
    scores = tl.full([BS, BT], -float("inf"), ACC)
    if tl.program_id(1) * BT < reduce_max(visible, 0):  # some query of the block sees some of these keys
        keys = _keys(k_ptr + b * stride_kb, ks_ptr + b * stride_ksb, t, t_ok, HD, q_ptr.dtype.element_ty, PACKED)
        total = tl.full([BS, BT], 0.0, ACC)
        for h in range(H):
            q = tl.load(q_ptr + b * stride_qb + s[:, None] * stride_qs + h * HD + dims[None, :], mask=s_ok[:, None],
                        other=0.0)
            w = tl.load(w_ptr + b * stride_wb + s * H + h, mask=s_ok, other=0.0).to(ACC)
            if IEEE:  # the interpreter (its bf16 dots are not exact) and float64: the same products in ACC
                dot = tl.dot(q.to(ACC), tl.trans(keys.to(ACC)), input_precision="ieee")
            else:
                dot = tl.dot(q, tl.trans(keys))
            head = tl.maximum(cast(dot.to(ACC), dtype).to(ACC), 0.0)
            total += cast(head * w[:, None], dtype).to(ACC)
        scores = tl.where(t[None, :] < visible[:, None], total, -float("inf"))
    tl.store(out_ptr + b * stride_ob + s[:, None] * N + t[None, :], cast(scores, dtype),
             mask=s_ok[:, None] & t_ok[None, :])


@triton.jit
def _candidate_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, blocks_ptr, vis_ptr, out_ptr, pos_ptr, S, H, W,
                             stride_qb, stride_qs, stride_wb, stride_ws, stride_kb, stride_ksb, stride_bb, stride_bs,
                             stride_vb, stride_ob, stride_os, HD: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr,
                             BLOCK: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, PACKED: tl.constexpr):
    """One query's scores of BT candidate slots (slot m: position blocks[m // BLOCK] * BLOCK + m % BLOCK), all
    heads in one dot; -inf and position -1 where the block is unused or the position not yet visible."""
    wait_for_inputs()
    b = tl.program_id(2)
    s = tl.program_id(1)
    m = tl.program_id(0) * BT + tl.arange(0, BT)
    m_ok = m < W
    block = tl.load(blocks_ptr + b * stride_bb + s * stride_bs + m // BLOCK, mask=m_ok, other=-1)
    position = block * BLOCK + m % BLOCK
    valid = (block >= 0) & (position < tl.load(vis_ptr + b * stride_vb + s))
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    keys = _keys(k_ptr + b * stride_kb, ks_ptr + b * stride_ksb, tl.where(valid, position, 0), valid, HD,
                 q_ptr.dtype.element_ty, PACKED)
    h = tl.arange(0, HP)
    h_ok = h < H
    q = tl.load(q_ptr + b * stride_qb + s * stride_qs + h[:, None] * HD + tl.arange(0, HD)[None, :],
                mask=h_ok[:, None], other=0.0)
    w = tl.load(w_ptr + b * stride_wb + s * stride_ws + h, mask=h_ok, other=0.0).to(ACC)
    if IEEE:
        dot = tl.dot(q.to(ACC), tl.trans(keys.to(ACC)), input_precision="ieee")
    else:
        dot = tl.dot(q, tl.trans(keys))
    head = tl.maximum(cast(dot.to(ACC), dtype).to(ACC), 0.0)  # padded heads: 0 x 0
    total = reduce_sum(cast(head * w[:, None], dtype).to(ACC), 0)
    out = b * stride_ob + s * stride_os + m
    tl.store(out_ptr + out, cast(tl.where(valid, total, -float("inf")), dtype), mask=m_ok)
    tl.store(pos_ptr + out, tl.where(valid, position, -1), mask=m_ok)


def _ieee(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" or q.dtype in (torch.float32, torch.float64)  # no TF32


def _key_operands(keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """(key pointer, scale pointer, batch strides, packed) of values [B,N,HD] or packed (codes, E8M0 bytes)."""
    if isinstance(keys, torch.Tensor):
        keys = keys.contiguous()
        return keys, keys, keys.stride(0), 0, False
    codes, scales = (t.contiguous() for t in keys)
    return codes, scales.view(torch.uint8), codes.stride(0), scales.stride(0), True


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 visible: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """kernels.index_scores's launch: q [B,S,H,HD], weights [B,S,H], keys [B,N,HD] (q's dtype) or a cache's
    packed keys (codes [B,cap,HD/2] uint8, E8M0 bytes [B,cap,HD/32]) of which the first `rows` are scored,
    visible [B,S] -> scores [B,S,N] in q's dtype."""
    batch, seq, heads, dim = q.shape
    n = keys.shape[1] if rows is None else rows
    q, weights, visible = q.contiguous(), weights.contiguous(), visible.contiguous()
    k_arg, ks_arg, stride_kb, stride_ksb, packed = _key_operands(keys)
    out = torch.empty(batch, seq, n, dtype=q.dtype, device=q.device)
    if not (seq and n):
        return out
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(seq, BLOCK_QUERIES), triton.cdiv(n, BLOCK_KEYS), batch)
    _index_scores_kernel[grid](q, weights, k_arg, ks_arg, visible, out, seq, n, heads, q.stride(0), q.stride(1),
                               weights.stride(0), stride_kb, stride_ksb, visible.stride(0), out.stride(0), HD=dim,
                               BS=BLOCK_QUERIES, BT=BLOCK_KEYS, ACC=acc, num_warps=INDEX_WARPS, IEEE=_ieee(q),
                               PACKED=packed, **launch_options())
    return out


def candidate_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     visible: torch.Tensor, blocks: torch.Tensor, block_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.index_scores.candidate_scores's launch: the scores [B,S,W] of each query's candidate positions
    (W = blocks' count x block_size, ascending) and those positions [B,S,W] (-1 where unused or not visible)."""
    batch, seq, heads, dim = q.shape
    width = blocks.shape[-1] * block_size
    q, weights, visible, blocks = q.contiguous(), weights.contiguous(), visible.contiguous(), blocks.contiguous()
    k_arg, ks_arg, stride_kb, stride_ksb, packed = _key_operands(keys)
    out = torch.empty(batch, seq, width, dtype=q.dtype, device=q.device)
    positions = torch.empty(batch, seq, width, dtype=blocks.dtype, device=q.device)
    if not (seq and width):
        return out, positions
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(width, CANDIDATE_KEYS), seq, batch)
    _candidate_scores_kernel[grid](
        q, weights, k_arg, ks_arg, blocks, visible, out, positions, seq, heads, width, q.stride(0), q.stride(1),
        weights.stride(0), weights.stride(1), stride_kb, stride_ksb, blocks.stride(0), blocks.stride(1),
        visible.stride(0), out.stride(0), out.stride(1), HD=dim, HP=max(MIN_DOT_ROWS, triton.next_power_of_2(heads)),
        BT=CANDIDATE_KEYS, BLOCK=block_size, ACC=acc, IEEE=_ieee(q), PACKED=packed, num_warps=CANDIDATE_WARPS,
        **launch_options())
    return out, positions
