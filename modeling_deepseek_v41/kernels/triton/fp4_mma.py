"""The grouped FP4 experts' products at decode sizes on the tensor cores (Gluon, Hopper's mma.sync).

Per program: one block of up to 8, 16 or 32 sorted rows of one expert, 128 weight rows, one split of K. mma_v2
(m16n8k16, fp16 in, fp32 accumulators) takes the weights as A and the block's rows as B, so a lane holds, per 32-column
group, one int32 word (8 values) of each of two weight rows, and turns it into eight fp16 values (the e2m1 values x
2^-6, exactly) with no data movement between lanes: the unpacking does not grow with the rows, where the CUDA-core rows
formulation pays an FMA per weight per row. Lane t reads word t of each group as shipped (columns 8t to 8t + 7), so each
MMA group stays in one scale group; the activations arrive as their e4m3 values in fp16 at common.mma_position
(quant.fp8_act_quant(mma_order=True)) with fp32 power-of-two scales per 32 columns, so every product is exact and each
group's fp32 dot is scaled by both scales. A row's sums do not depend on the block's other rows or on its size (each MMA
output is its own row's dot) and the split of K is a constant: batch invariant.

Launched like the Triton kernels, programmatic dependent launch included: mma_common.wait_for_inputs issues the
grid-dependency wait that Gluon has no op for.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .common import _FP4_WORD_ASM
from .mma_common import A_OPERAND, B_OPERAND, MMA, SLICE, activations_layout, split_groups, wait_for_inputs
from .launch import launch_options

_SLICE = gl.constexpr(SLICE)
# the kernel's PREFETCH when a call does not say (H100, one 384-expert layer at one token: 82.8 against 88.8 us;
# the same from 6 tokens; kernel_tuning.py --only moe)
PREFETCH = True


@gluon.jit
def _e8m0_x64(byte):
    """2^(byte - 127) x 2^6 from E8M0 bytes (the unpacked nibbles are the e2m1 values x 2^-6): the exponent plus 6,
    exact for every byte below 250, 0 included (2^-121, a normal number)."""
    return (((byte & 0xFF) + 6) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _group_dot(acc, word, xg, sw, sx, BN: gl.constexpr, BM: gl.constexpr, WORD_ASM: gl.constexpr):
    """acc + (one group's weights [BN, 32] from the lanes' words [BN, 4] . x's 32 columns xg [32, BM]) x scales."""
    v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
        WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [word], (gl.float16,) * 8, True, 1)
    # [n, t, a, b, c] (a: v0|v2 ..., b: v0|v1 ..., c: v0|v4) -> [n, c, b, t, a] = [n, k], k = 16c + 8b + 2t + a:
    # the PTX leaves nibbles 0 and 2 (1 and 3, 4 and 6, 5 and 7) in one register, so they are k's neighbours
    values = gl.join(gl.join(gl.join(v0, v2), gl.join(v1, v3)), gl.join(gl.join(v4, v6), gl.join(v5, v7)))
    values = gl.convert_layout(gl.reshape(gl.permute(values, [0, 4, 3, 1, 2]), [BN, 32]), A_OPERAND)
    d = mma_v2(values, xg, gl.zeros([BN, BM], gl.float32, MMA))
    return acc + d * (sw[:, None] * sx[None, :])


@gluon.jit
def _slice_words(w_rows, s_rows, k):
    """The [BN, 4 lanes, 4 groups] words of the 128-column slice at column k and its 4 groups' scale bytes (one
    int32 per weight row)."""
    return gl.load(w_rows + k // 8), gl.load((s_rows + k // 32).to(gl.pointer_type(gl.int32), bitcast=True))


@gluon.jit
def _fp4_mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, pair_ptr, block_expert_ptr, block_start_ptr,
                    block_end_ptr, P, N, K, k_chunk, top_k, stride_xm, stride_xsm, stride_we, stride_wn, stride_se,
                    stride_sn, w2_ptr, s2_ptr, N2, tiles1, BN: gl.constexpr, BM: gl.constexpr,
                    WORD_ASM: gl.constexpr, ROWS_ARE_TOKENS: gl.constexpr, PREFETCH: gl.constexpr):
    """out[split, r, n] = sum over this split's k of x[token(r), k] w[expert, n, k], fp32, for the block's rows
    (token(r) = pair(r) // top_k, or r itself). Tiles past `tiles1` take a second stack w2 (scales s2, the same
    strides) into columns N to N + N2. PREFETCH: the next slice's words and scales are loaded before this slice's
    MMAs (Gluon issues loads where they stand; the last slice loads itself again, from cache)."""
    wait_for_inputs()
    XL: gl.constexpr = activations_layout(BM)
    # [128 rows, 4 t, 4 groups] words where the A fragments want them: lane 4 (row % 8) + t holds rows r and r + 8
    # of its warp's 16-row tile (and + 64), word t of each group
    WORDS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [64, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[128, 4, 4])
    gl.static_assert(BN == 128, "the words' layout is written for 128 weight rows per program")
    b = gl.program_id(0)
    tile = gl.program_id(1)
    NT = N + N2
    col0 = (tile >= tiles1).to(gl.int32) * N  # the second stack's columns after the first's
    if tile >= tiles1:
        w_ptr, s_ptr, N = w2_ptr, s2_ptr, N2
        tile -= tiles1
    start = gl.load(block_start_ptr + b)
    end = gl.load(block_end_ptr + b)
    if start < end:
        expert = gl.load(block_expert_ptr + b).to(gl.int64)
        n0 = tile * BN
        k_start = gl.program_id(2) * k_chunk
        k_stop = gl.minimum(k_start + k_chunk, K)
        n_w = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS))), N - 1)
        t_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
        g_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
        w_rows = (w_ptr + expert * stride_we + n_w[:, None, None].to(gl.int64) * stride_wn + t_w[None, :, None]
                  + 4 * g_w[None, None, :])
        r_x = start + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        if ROWS_ARE_TOKENS:  # the down projection: sorted row r reads h's row r
            tok_x = r_x.to(gl.int64)
        else:
            tok_x = (gl.load(pair_ptr + r_x, mask=r_x < end, other=0) // top_k).to(gl.int64)
        t_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        g_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
        i_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
        x_rows = (x_ptr + tok_x[:, None, None, None] * stride_xm + 32 * t_x[None, :, None, None]
                  + 8 * g_x[None, None, :, None] + i_x[None, None, None, :])
        x_ok = (r_x < end)[:, None, None, None] & (i_x >= 0)[None, None, None, :]
        n_c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        r_c = start + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
        if ROWS_ARE_TOKENS:
            tok_c = r_c.to(gl.int64)
        else:
            tok_c = (gl.load(pair_ptr + r_c, mask=r_c < end, other=0) // top_k).to(gl.int64)
        s_rows = s_ptr + expert * stride_se + gl.minimum(n_c, N - 1).to(gl.int64) * stride_sn
        xs_rows = xs_ptr + tok_c * stride_xsm
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        if PREFETCH:
            words, bytes4 = _slice_words(w_rows, s_rows, k_start)
        for k in range(k_start, k_stop, _SLICE):
            if PREFETCH:
                words_next, bytes4_next = _slice_words(w_rows, s_rows, gl.minimum(k + _SLICE, k_stop - _SLICE))
            else:
                words, bytes4 = _slice_words(w_rows, s_rows, k)
            w0, w1, w2, w3 = split_groups(gl.reshape(words, [BN, 4, 2, 2]))
            xs4 = gl.load(x_rows + k, mask=x_ok, other=0.0)  # [BM, 4, 4, 8]
            x0, x1, x2, x3 = split_groups(gl.reshape(gl.permute(xs4, [0, 1, 3, 2]), [BM, 4, 8, 2, 2]))
            for g in gl.static_range(4):
                word = w0 if g == 0 else w1 if g == 1 else w2 if g == 2 else w3
                xq = x0 if g == 0 else x1 if g == 1 else x2 if g == 2 else x3  # [BM rows, 4 t, 8 i]
                # [n, t, c, a, b] (i = 4c + 2a + b: k = 16c + 8b + 2t + a) -> [c, b, t, a, n] = [k, n]
                xg = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(xq, [BM, 4, 2, 2, 2]), [2, 4, 1, 3, 0]),
                                                  [32, BM]), B_OPERAND)
                sw = _e8m0_x64(bytes4 >> (8 * g))
                sx = gl.load(xs_rows + k // 32 + g, mask=r_c < end, other=0.0)
                acc = _group_dot(acc, word, xg, sw, sx, BN, BM, WORD_ASM)
            if PREFETCH:
                words, bytes4 = words_next, bytes4_next
        out = (out_ptr + gl.program_id(2).to(gl.int64) * P * NT + r_c[None, :].to(gl.int64) * NT + col0
               + n_c[:, None])
        gl.store(out, acc, mask=(n_c < N)[:, None] & (r_c < end)[None, :])


def fp4_mma_partials(x_codes: torch.Tensor, x_scales: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                     pair_of_row: torch.Tensor | None, top_k: int, block_expert: torch.Tensor,
                     block_start: torch.Tensor, block_end: torch.Tensor, k_chunk: int, block_rows: int,
                     second: tuple[torch.Tensor, torch.Tensor] | None = None, prefetch: bool | None = None
                     ) -> torch.Tensor:
    """Split partials [splits, P, N (+ N)] fp32 of the sorted rows' products with their expert's packed FP4 weight
    (and with a second stack's of the same shape, its columns after the first's). x_codes [T, K] fp16 e4m3 values
    at mma_position, x_scales [T, K/32] fp32; w [E, N, K/2] packed e2m1 as shipped; scales [E, N, K/32] E8M0;
    pair_of_row [P] int32 (sorted row r reads x's row pair_of_row[r] // top_k), or None (it reads row r); blocks
    of <= block_rows (8, 16 or 32) rows of one expert (moe_schedule). prefetch: the kernel's PREFETCH (None: the
    module's)."""
    e, n, half_k = w.shape
    k = half_k * 2
    if block_rows not in (8, 16, 32) or k % SLICE or not (w.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"the tensor-core decode takes blocks of 8, 16 or 32 rows and contiguous stacks and scales "
                         f"of whole {SLICE}-column slices (block rows {block_rows}, K = {k})")
    w2, s2 = second if second is not None else (w, scales)
    if w2.shape != w.shape or w2.stride() != w.stride() or s2.stride() != scales.stride():
        raise ValueError("the second stack must have the first's shape and strides")
    n2 = n if second is not None else 0
    p = pair_of_row.shape[0] if pair_of_row is not None else x_codes.shape[0]
    k_chunk = triton.cdiv(k_chunk, SLICE) * SLICE
    splits = triton.cdiv(k, k_chunk)
    out = torch.empty(splits, p, n + n2, dtype=torch.float32, device=x_codes.device)
    words, words2 = w.view(torch.int32), w2.view(torch.int32)
    s, s2 = scales.view(torch.uint8), s2.view(torch.uint8)
    tiles1 = triton.cdiv(n, 128)
    grid = (block_expert.shape[0], tiles1 + triton.cdiv(n2, 128), splits)
    pairs = pair_of_row if pair_of_row is not None else block_expert
    _fp4_mma_kernel[grid](x_codes, x_scales, words, s, out, pairs, block_expert, block_start, block_end, p, n, k,
                          k_chunk, top_k, x_codes.stride(0), x_scales.stride(0), words.stride(0), words.stride(1),
                          s.stride(0), s.stride(1), words2, s2, n2, tiles1, BN=128, BM=block_rows,
                          WORD_ASM=_FP4_WORD_ASM.value,
                          ROWS_ARE_TOKENS=pair_of_row is None,
                          PREFETCH=PREFETCH if prefetch is None else prefetch, num_warps=4,
                          **launch_options())
    return out
