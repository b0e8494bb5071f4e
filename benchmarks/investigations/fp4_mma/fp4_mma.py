"""A candidate decode formulation of the grouped FP4 MoE on the tensor cores (Gluon, Triton 3.6): not wired into
the model, awaiting its first GPU run (see README.md).

Per program: one block of up to 16 sorted rows of one expert, BN weight rows, one split of K. mma_v2 (m16n8k16,
fp16 in, fp32 accumulators) takes the block's rows as A and the weights as B, so a lane holds, per 32 columns, 8
values of one weight row: k = (i & 1) + 2t + 8 * (i >> 1 & 1) + 16 * (i >> 2) for nibble i of the row's word t.
`permute_fp4_words` reorders the packed nibbles within each 32-column group once, at load, so that word t holds
exactly those; the lane turns it into eight fp16 values (the e2m1 value times 2^-6, exactly) with no data movement
between lanes. The activations arrive as their e4m3 values in fp16 with fp32 power-of-two scales per 32 columns
(quant.fp8_act_quant), so every product is exact and each group's fp32 dot is scaled by both scales (and 2^6)."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# int32 word of packed e2m1 -> 8 fp16 (nibble i -> output i), values x 2^-6: modeling_deepseek_v41's PTX block
from modeling_deepseek_v41.kernels.triton.common import _FP4_WORD_ASM

BM = gl.constexpr(16)  # the MMA's rows: a block's rows (one expert), padded


def lane_columns() -> torch.Tensor:
    """[4, 8]: the group column that nibble i of word t carries (the B fragment of m16n8k16, two k-steps)."""
    t = torch.arange(4)[:, None]
    i = torch.arange(8)[None, :]
    return (i & 1) + 2 * t + 8 * ((i >> 1) & 1) + 16 * (i >> 2)


SLICE = 128  # columns per loop step: four 32-column groups, each lane's four words in one 16-byte load
_SLICE = gl.constexpr(SLICE)


def permute_fp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] (byte j: columns 2j low, 2j+1 high; K a multiple of SLICE) -> int32 words
    [..., N, K/8]: in each SLICE-column slice, nibble i of word 4t + g is column 32g + lane_columns()[t, i]."""
    codes = torch.stack((packed.to(torch.uint8) & 15, packed.to(torch.uint8) >> 4), dim=-1).flatten(-2)
    k = codes.shape[-1]
    if k % SLICE:
        raise ValueError(f"K ({k}) must be a multiple of {SLICE}")
    cols = lane_columns()  # [t, i]
    within = (32 * torch.arange(4)[None, :, None] + cols[:, None, :]).reshape(-1)  # [t, g, i] -> column
    perm = (torch.arange(0, k, SLICE)[:, None] + within[None, :]).reshape(-1).to(codes.device)
    codes = codes.index_select(-1, perm)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.int32)


@gluon.jit
def _e8m0(byte):
    byte = byte.to(gl.int32) & 0xFF
    return gl.where(byte == 0, 5.877471754111438e-39, (byte << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _group_dot(acc, word, a, sw, sx, B_L: gl.constexpr, MMA: gl.constexpr, BN: gl.constexpr,
               WORD_ASM: gl.constexpr):
    """acc + (x's 32 columns a [16, 32] . one group's weights [32, BN] from lane-ordered words [4, BN]) x scales."""
    v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
        WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [word], (gl.float16,) * 8, True, 1)
    # [t, n, i0, i1, i2] -> [i2, i1, t, i0, n] = [k, n] with k = 16 i2 + 8 i1 + 2 t + i0 (lane_columns)
    values = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    values = gl.convert_layout(gl.reshape(gl.permute(values, [4, 3, 0, 2, 1]), [32, BN]), B_L)
    d = mma_v2(a, values, gl.zeros([BM, BN], gl.float32, MMA))
    return acc + d * (sx[:, None] * sw[None, :])


@gluon.jit
def _fp4_mma_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, row_token_ptr, block_expert_ptr, block_start_ptr,
                    block_end_ptr, P, N, K, k_chunk, stride_xm, stride_xsm, stride_we, stride_wn, stride_se,
                    stride_sn, BN: gl.constexpr, WORD_ASM: gl.constexpr):
    """out[split, r, n] = sum over this split's k of x[token(r), k] w[expert, n, k], fp32, for the block's rows."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # lane 4r + t holds weight row r's words 4t..4t+3 of a slice (one per group): one 16-byte load
    WORDS: gl.constexpr = gl.BlockedLayout([1, 1, 4], [4, 8, 1], [1, 4, 1], [2, 0, 1])
    b = gl.program_id(0)
    start = gl.load(block_start_ptr + b)
    end = gl.load(block_end_ptr + b)
    if start < end:
        expert = gl.load(block_expert_ptr + b).to(gl.int64)
        n0 = gl.program_id(1) * BN
        k_start = gl.program_id(2) * k_chunk
        k_stop = gl.minimum(k_start + k_chunk, K)
        t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, WORDS)))
        n_w = gl.minimum(n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, WORDS))), N - 1)
        g_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WORDS)))
        w_rows = (w_ptr + expert * stride_we + n_w[None, :, None].to(gl.int64) * stride_wn + 4 * t[:, None, None]
                  + g_w[None, None, :])
        r_a = start + gl.arange(0, BM, layout=gl.SliceLayout(1, A_L))
        tok_a = gl.load(row_token_ptr + r_a, mask=r_a < end, other=0).to(gl.int64)
        c_a = gl.arange(0, 32, layout=gl.SliceLayout(0, A_L))
        x_rows = x_ptr + tok_a[:, None] * stride_xm + c_a[None, :]
        a_ok = (r_a < end)[:, None] & (c_a >= 0)[None, :]
        r_c = start + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
        tok_c = gl.load(row_token_ptr + r_c, mask=r_c < end, other=0).to(gl.int64)
        n_c = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
        s_rows = s_ptr + expert * stride_se + gl.minimum(n_c, N - 1).to(gl.int64) * stride_sn
        xs_rows = xs_ptr + tok_c * stride_xsm
        acc = gl.zeros([BM, BN], gl.float32, MMA)
        for k in range(k_start, k_stop, _SLICE):
            words = gl.load(w_rows + k // 8)  # [4 lanes, BN, 4 groups]
            even, odd = gl.split(gl.reshape(words, [4, BN, 2, 2]))  # groups 0 and 2, 1 and 3
            w0, w2 = gl.split(even)
            w1, w3 = gl.split(odd)
            bytes4 = gl.load((s_rows + k // 32).to(gl.pointer_type(gl.int32), bitcast=True))  # the 4 groups' scales
            for g in gl.static_range(4):
                word = w0 if g == 0 else w1 if g == 1 else w2 if g == 2 else w3
                sw = _e8m0(bytes4 >> (8 * g)) * 64.0  # the nibbles' values are x 2^-6
                sx = gl.load(xs_rows + k // 32 + g, mask=r_c < end, other=0.0)
                a = gl.load(x_rows + k + 32 * g, mask=a_ok, other=0.0)
                acc = _group_dot(acc, word, a, sw, sx, B_L, MMA, BN, WORD_ASM)
        out = out_ptr + gl.program_id(2).to(gl.int64) * P * N + r_c[:, None].to(gl.int64) * N + n_c[None, :]
        gl.store(out, acc, mask=(r_c < end)[:, None] & (n_c < N)[None, :])


def grouped_fp4_mma(x_codes: torch.Tensor, x_scales: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                    row_token: torch.Tensor, block_expert: torch.Tensor, block_start: torch.Tensor,
                    block_end: torch.Tensor, k_chunk: int, bn: int = 128) -> torch.Tensor:
    """Split partials [splits, P, N] fp32 of the sorted rows' products with their expert's permuted FP4 weight.
    x_codes [T, K] fp16 e4m3 values, x_scales [T, K/32] fp32; words [E, N, K/8] (permute_fp4_words); scales
    [E, N, K/32] E8M0 bytes; row_token [P] int32 (a sorted row's token); blocks of <= 16 rows of one expert."""
    e, n, kw = words.shape
    k = kw * 8
    p = row_token.shape[0]
    k_chunk = triton.cdiv(k_chunk, SLICE) * SLICE
    splits = triton.cdiv(k, k_chunk)
    out = torch.empty(splits, p, n, dtype=torch.float32, device=x_codes.device)
    s = scales.view(torch.uint8)
    grid = (block_expert.shape[0], triton.cdiv(n, bn), splits)
    _fp4_mma_kernel[grid](x_codes, x_scales, words, s, out, row_token, block_expert, block_start, block_end, p, n,
                          k, k_chunk, x_codes.stride(0), x_scales.stride(0), words.stride(0), words.stride(1),
                          s.stride(0), s.stride(1), BN=bn, WORD_ASM=_FP4_WORD_ASM.value, num_warps=4)
    return out
