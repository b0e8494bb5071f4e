"""The CSA2 indexer's scores in one launch: score[s, t] = sum_h relu(q[s,h] . k[t]) * w[s,h], only the [S, N]
result written.

The exact path materializes the per-head scores [S, H, N] and passes over them for the ReLU, the weights and the
sum over heads: at a 64K prompt that is hundreds of GB per layer. Here a program holds BT keys and walks the heads
for BS queries; blocks of keys no query of the block may see yet are skipped. The roundings are the exact path's:
each head's dot (fp32 sums) rounded to the scores' dtype, the weighted ReLU rounded again, the sum over heads in
fp32 rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, reduce_max

BLOCK_QUERIES, BLOCK_KEYS = 64, 128
INDEX_WARPS = 8


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, S, N, H, stride_qb, stride_qs, stride_wb,
                         stride_kb, stride_vb, stride_ob, HD: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                         ACC: tl.constexpr, IEEE: tl.constexpr):
    """Scores of queries s0 .. s0+BS against keys t0 .. t0+BT of batch row b; -inf where t >= visible[s]."""
    b = tl.program_id(2)
    s = tl.program_id(0) * BS + tl.arange(0, BS)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    s_ok, t_ok = s < S, t < N
    visible = tl.load(vis_ptr + b * stride_vb + s, mask=s_ok, other=0)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    dims = tl.arange(0, HD)
    scores = tl.full([BS, BT], -float("inf"), ACC)
    if tl.program_id(1) * BT < reduce_max(visible, 0):  # some query of the block sees some of these keys
        keys = tl.load(k_ptr + b * stride_kb + t[:, None] * HD + dims[None, :], mask=t_ok[:, None], other=0.0)
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


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """kernels.index_scores's launch: q [B,S,H,HD], weights [B,S,H], keys [B,N,HD] (q's dtype), visible [B,S] ->
    scores [B,S,N] in q's dtype."""
    batch, seq, heads, dim = q.shape
    n = keys.shape[1]
    q, weights, keys, visible = q.contiguous(), weights.contiguous(), keys.contiguous(), visible.contiguous()
    out = torch.empty(batch, seq, n, dtype=q.dtype, device=q.device)
    if not (seq and n):
        return out
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(seq, BLOCK_QUERIES), triton.cdiv(n, BLOCK_KEYS), batch)
    _index_scores_kernel[grid](q, weights, keys, visible, out, seq, n, heads, q.stride(0), q.stride(1),
                               weights.stride(0), keys.stride(0), visible.stride(0), out.stride(0), HD=dim,
                               BS=BLOCK_QUERIES, BT=BLOCK_KEYS, ACC=acc, num_warps=INDEX_WARPS,
                               IEEE=q.device.type == "cpu" or q.dtype in (torch.float32, torch.float64))  # no TF32
    return out
