"""A candidate decode formulation of the grouped FP4 MoE on the tensor cores (Gluon, Triton 3.6): not wired into
the model, awaiting its first GPU run (see README.md).

Per program: one block of up to 8 sorted rows of one expert, BN = 128 weight rows, one split of K. mma_v2
(m16n8k16, fp16 in, fp32 accumulators) takes the weights as A and the block's rows as B, so a lane holds, per 32
columns, 8 values of each of two weight rows: one int32 word each, which the lane turns into eight fp16 values
(the e2m1 value times 2^-6, exactly) with no data movement between lanes. Which columns a word holds is the
weights' order (shared.py): NATURAL reads the shipped bytes (word t of a group: columns 8t to 8t + 7), FP4_WORDS
reads stacks permuted once at load (`permute_fp4_words`) so a lane's four words of a slice are one 16-byte load.
The activations arrive as their e4m3 values in fp16 at the positions of the same order, with fp32 power-of-two
scales per 32 columns, so every product is exact and each group's fp32 dot is scaled by both scales (and 2^6)."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from shared import FP4_WORDS, slice_permutation, split_groups

# int32 word of packed e2m1 -> 8 fp16 (nibble i -> output i), values x 2^-6: modeling_deepseek_v41's PTX block
from modeling_deepseek_v41.kernels.triton.common import _FP4_WORD_ASM

BM = gl.constexpr(8)  # the MMA's columns: a block's rows (one expert), padded


SLICE = 128  # columns per loop step: four 32-column groups
_SLICE = gl.constexpr(SLICE)


def permute_fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] (byte j: columns 2j low, 2j+1 high) -> int32 words [..., N, K/8] in the FP4_WORDS
    order: nibble i of word 4t + g of a slice is its column 32g + lane_columns(FP4_WORDS)[t, i], so a lane's four
    words of a slice are one 16-byte load."""
    codes = torch.stack((packed.to(torch.uint8) & 15, packed.to(torch.uint8) >> 4), dim=-1).flatten(-2)
    codes = codes.index_select(-1, slice_permutation(codes.shape[-1], FP4_WORDS).to(codes.device))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.int32)


def natural_fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """The shipped packed bytes [..., N, K/2] as int32 words [..., N, K/8], no copy: nibble i of word 4g + t of a
    slice is column 32g + 8t + i (the NATURAL order)."""
    return packed.view(torch.int32)


def word_index(t, g, natural: bool):
    """The word of a slice that lane t reads for group g (the kernel's addresses)."""
    return t + 4 * g if natural else 4 * t + g


@gluon.jit
def _e8m0_x64(byte):
    """2^(byte - 127) x 2^6 from E8M0 bytes (the unpacked nibbles are the e2m1 values x 2^-6): the exponent plus 6,
    exact for every byte below 250, 0 included (2^-121, a normal number)."""
    return (((byte & 0xFF) + 6) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _group_dot(acc, word, xg, sw, sx, A_L: gl.constexpr, MMA: gl.constexpr, BN: gl.constexpr,
               WORD_ASM: gl.constexpr):
    """acc + (one group's weights [BN, 32] from lane-ordered words [BN, 4] . x's 32 columns xg [32, BM]) x scales."""
    v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
        WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [word], (gl.float16,) * 8, True, 1)
    # [n, t, a, b, c] (a: v0|v2 ..., b: v0|v1 ..., c: v0|v4) -> [n, c, b, t, a] = [n, k], k = 16c + 8b + 2t + a:
    # the asm leaves nibbles 0 and 2 (1 and 3, 4 and 6, 5 and 7) in one register, so they are k's neighbours
    values = gl.join(gl.join(gl.join(v0, v2), gl.join(v1, v3)), gl.join(gl.join(v4, v6), gl.join(v5, v7)))
    values = gl.convert_layout(gl.reshape(gl.permute(values, [0, 4, 3, 1, 2]), [BN, 32]), A_L)
    d = mma_v2(values, xg, gl.zeros([BN, BM], gl.float32, MMA))
    return acc + d * (sw[:, None] * sx[None, :])


@gluon.jit
def _fp4_mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, row_token_ptr, block_expert_ptr, block_start_ptr,
                    block_end_ptr, P, N, K, k_chunk, stride_xm, stride_xsm, stride_we, stride_wn, stride_se,
                    stride_sn, w2_ptr, s2_ptr, N2, tiles1, BN: gl.constexpr, WORD_ASM: gl.constexpr,
                    ROWS_ARE_TOKENS: gl.constexpr, NATURAL: gl.constexpr):
    """out[split, r, n] = sum over this split's k of x[token(r), k] w[expert, n, k], fp32, for the block's rows.
    Tiles past `tiles1` take a second stack w2 [E, N2, K/8] (scales s2, the same strides) into the output's
    columns N to N + N2: w1 and w3 in one launch."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # [BN = 128 rows, 4 t, 4 groups] words placed as the A fragments want them: lane 4 (row % 8) + t holds rows
    # r and r + 8 of its warp's 16-row tile (and + 64), its four words of a slice (one per group) in one load
    WORDS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [64, 0, 0]], lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0],
                                                                             [2, 0, 0], [4, 0, 0]],
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
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS)))
        g_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
        if NATURAL:  # the shipped bytes: a lane's words of a slice 16 bytes apart
            w_rows = (w_ptr + expert * stride_we + n_w[:, None, None].to(gl.int64) * stride_wn + t[None, :, None]
                      + 4 * g_w[None, None, :])
        else:  # permuted at load: a lane's four words of a slice in one 16-byte load
            w_rows = (w_ptr + expert * stride_we + n_w[:, None, None].to(gl.int64) * stride_wn
                      + 4 * t[None, :, None] + g_w[None, None, :])
        # the slice's activations of the block's rows in the order's positions: [8 rows, 4 t, 4 groups, 8 i],
        # lane 4 row + t holding its 32 values (8 per group) of the slice in four 16-byte loads
        XL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0]],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[0, 0, 0, 0], [0, 0, 0, 0]], block_bases=[], shape=[8, 4, 4, 8])
        r_x = start + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
        if ROWS_ARE_TOKENS:  # the down projection: sorted row r reads h's row r
            tok_x = r_x.to(gl.int64)
        else:
            tok_x = gl.load(row_token_ptr + r_x, mask=r_x < end, other=0).to(gl.int64)
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
            tok_c = gl.load(row_token_ptr + r_c, mask=r_c < end, other=0).to(gl.int64)
        s_rows = s_ptr + expert * stride_se + gl.minimum(n_c, N - 1).to(gl.int64) * stride_sn
        xs_rows = xs_ptr + tok_c * stride_xsm
        acc = gl.zeros([BN, BM], gl.float32, MMA)
        for k in range(k_start, k_stop, _SLICE):
            words = gl.load(w_rows + k // 8)  # [BN, 4 lanes, 4 groups]
            w0, w1, w2, w3 = split_groups(gl.reshape(words, [BN, 4, 2, 2]))
            bytes4 = gl.load((s_rows + k // 32).to(gl.pointer_type(gl.int32), bitcast=True))  # the 4 groups' scales
            xs4 = gl.load(x_rows + k, mask=x_ok, other=0.0)  # [8, 4, 4, 8]
            x0, x1, x2, x3 = split_groups(gl.reshape(gl.permute(xs4, [0, 1, 3, 2]), [8, 4, 8, 2, 2]))
            for g in gl.static_range(4):
                word = w0 if g == 0 else w1 if g == 1 else w2 if g == 2 else w3
                xq = x0 if g == 0 else x1 if g == 1 else x2 if g == 2 else x3  # [8 rows, 4 t, 8 i]
                # [n, t, c, a, b] (i = 4c + 2a + b: k = 16c + 8b + 2t + a) -> [c, b, t, a, n] = [k, n]
                xg = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(xq, [8, 4, 2, 2, 2]), [2, 4, 1, 3, 0]),
                                                  [32, BM]), B_L)
                sw = _e8m0_x64(bytes4 >> (8 * g))
                sx = gl.load(xs_rows + k // 32 + g, mask=r_c < end, other=0.0)
                acc = _group_dot(acc, word, xg, sw, sx, A_L, MMA, BN, WORD_ASM)
        out = (out_ptr + gl.program_id(2).to(gl.int64) * P * NT + r_c[None, :].to(gl.int64) * NT + col0
               + n_c[:, None])
        gl.store(out, acc, mask=(n_c < N)[:, None] & (r_c < end)[None, :])


def grouped_fp4_mma(x_codes: torch.Tensor, x_scales: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                    row_token: torch.Tensor | None, block_expert: torch.Tensor, block_start: torch.Tensor,
                    block_end: torch.Tensor, k_chunk: int, second: tuple[torch.Tensor, torch.Tensor] | None = None,
                    natural: bool = True, bn: int = 128) -> torch.Tensor:
    """Split partials [splits, P, N (+ N2)] fp32 of the sorted rows' products with their expert's FP4 weight (and
    with a second stack's: `second` = (words2, scales2) of the same shape, its columns after the first's). x_codes
    [T, K] fp16 e4m3 values in the order's positions (act_quant_permuted), x_scales [T, K/32] fp32; words [E, N,
    K/8] int32: natural_fp4_words (natural) or permute_fp4_words; scales [E, N, K/32] E8M0 bytes; row_token [P]
    int32 (a sorted row's token), or None when sorted row r reads x's row r; blocks of <= 8 rows of one expert."""
    e, n, kw = words.shape
    k = kw * 8
    w2, s2 = second if second is not None else (words, scales)
    if w2.shape != words.shape or w2.stride() != words.stride() or s2.stride() != scales.stride():
        raise ValueError("the second stack must have the first's shape and strides")
    n2 = n if second is not None else 0
    p = row_token.shape[0] if row_token is not None else x_codes.shape[0]
    k_chunk = triton.cdiv(k_chunk, SLICE) * SLICE
    splits = triton.cdiv(k, k_chunk)
    out = torch.empty(splits, p, n + n2, dtype=torch.float32, device=x_codes.device)
    s, s2 = scales.view(torch.uint8), s2.view(torch.uint8)
    tiles1 = triton.cdiv(n, bn)
    grid = (block_expert.shape[0], tiles1 + triton.cdiv(n2, bn), splits)
    tokens = row_token if row_token is not None else block_expert
    _fp4_mma_kernel[grid](x_codes, x_scales, words, s, out, tokens, block_expert, block_start, block_end, p, n,
                          k, k_chunk, x_codes.stride(0), x_scales.stride(0), words.stride(0), words.stride(1),
                          s.stride(0), s.stride(1), w2, s2, n2, tiles1, BN=bn, WORD_ASM=_FP4_WORD_ASM.value,
                          ROWS_ARE_TOKENS=row_token is None, NATURAL=natural, num_warps=4)
    return out
