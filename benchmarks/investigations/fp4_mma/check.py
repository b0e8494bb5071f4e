"""Checks of the candidate FP4 MMA formulation (fp4_mma.py).

    python check.py layout          # CPU: the load-time permutation puts each column where the kernel reads it
    python check.py emulate         # CPU: the kernel's steps (splits, joins, permutes, reshapes) in torch
    python check.py finish          # CPU (interpreter): the launches around it, against torch
    python check.py moe             # CPU (interpreter): mma_moe, the MMA kernel emulated, against grouped_moe
    python check.py sass out.sass   # CPU: compile for sm_90 with the Triton 3.6 wheel in /tmp/t36, loop mix
    python check.py gpu             # H200: the kernel against the dequantized product; timing against moe_rows
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
if len(sys.argv) > 1 and sys.argv[1] == "sass":
    sys.path.insert(0, "/tmp/t36")
elif len(sys.argv) < 2 or sys.argv[1] != "gpu":
    os.environ["TRITON_INTERPRET"] = "1"  # the CPU checks run the Triton (not Gluon) launches in the interpreter
sys.path[:0] = [HERE, os.path.dirname(HERE), ROOT]

import torch  # noqa: E402


def random_packed(e, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 128, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scales


def check_layout():
    from fp4_mma import lane_columns, permute_fp4_words
    e, n, k = 2, 8, 256
    packed, _ = random_packed(e, n, k)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [e, n, k] column order
    words = permute_fp4_words(packed)  # [e, n, k/8] int32
    nib = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)  # [e, n, k/8, 8]: nibble i of word w
    cols = lane_columns()
    rebuilt = torch.empty_like(codes)
    for s in range(k // 128):  # word 4t + g of a 128-column slice: group g's nibbles for lane t
        for g in range(4):
            for t in range(4):
                for i in range(8):
                    rebuilt[:, :, 128 * s + 32 * g + cols[t, i]] = nib[:, :, 16 * s + 4 * t + g, i].to(torch.uint8)
    assert torch.equal(rebuilt, codes), "a permuted nibble is not the column the kernel reads it as"
    from fp4_mma import permute_activations
    x = torch.arange(k, dtype=torch.float32).expand(2, k)
    xp = permute_activations(x)  # the kernel's x offsets 32t + 8g + i must hold the weights' column of (t, g, i)
    for t in range(4):
        for g in range(4):
            for i in range(8):
                assert xp[0, 32 * t + 8 * g + i] == 32 * g + cols[t, i]
    assert sorted(cols.reshape(-1).tolist()) == list(range(32))
    print("layout: every column of every group is where the kernel's lanes read it")


def _nibble_values(word):
    """fp4_word_nibbles' eight outputs (nibble i as its e2m1 value x 2^-6) in torch."""
    from modeling_deepseek_v41.kernels.numerics import fp4_dequantize_rows  # noqa: F401  (the package imports)
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]) / 64
    return [table[((word >> (4 * i)) & 15).long()] for i in range(8)]


def _join(a, b):
    return torch.stack((a, b), dim=-1)  # gl.join: the pair on a new last axis


def check_emulate():
    """The Gluon kernel's per-program steps in torch (gl.join/split/permute/reshape have torch's semantics), over a
    schedule's blocks, against the dense product of the QDQ'd activations and the dequantized experts."""
    from fp4_mma import permute_activations, permute_fp4_words
    from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight, fp8_act_qdq
    e, n, k, tokens, top_k, bn, bm = 4, 256, 512, 5, 2, 128, 8
    packed, scales = random_packed(e, n, k, seed=3)
    words = permute_fp4_words(packed)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(4))
    xq = fp8_act_qdq(x)
    xs = (xq.view(tokens, -1, 32).abs().amax(-1).clamp_min(1e-30))  # any per-group power of two works: use QDQ's
    xs = torch.exp2(torch.ceil(torch.log2(xs / 448)))
    codes = (xq.view(tokens, -1, 32) / xs[..., None]).view(tokens, k)
    xp = permute_activations(codes)
    experts = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(10 + i))[:top_k]
                           for i in range(tokens)])
    pairs = [(tok, int(ex)) for tok in range(tokens) for ex in experts[tok]]
    for ex in range(e):  # blocks of up to bm rows of one expert
        rows = [tok for tok, which in pairs if which == ex]
        for b0 in range(0, len(rows), bm):
            block = rows[b0:b0 + bm]
            acc = torch.zeros(n, bm)
            for n0 in range(0, n, bn):
                for k0 in range(0, k, 128):
                    wds = words[ex, n0:n0 + bn, k0 // 8:k0 // 8 + 16].view(bn, 4, 4)  # [BN, t, g]
                    even, odd = wds.view(bn, 4, 2, 2).unbind(-1)
                    w0, w2 = even.unbind(-1)
                    w1, w3 = odd.unbind(-1)
                    xs4 = torch.zeros(bm, 4, 4, 8)
                    xs4[:len(block)] = xp[block, k0:k0 + 128].view(len(block), 4, 4, 8)
                    x_even, x_odd = xs4.view(bm, 4, 2, 2, 8).permute(0, 1, 2, 4, 3).unbind(-1)
                    x0, x2 = x_even.permute(0, 1, 3, 2).unbind(-1)
                    x1, x3 = x_odd.permute(0, 1, 3, 2).unbind(-1)
                    for g in range(4):
                        word, xq_g = (w0, w1, w2, w3)[g], (x0, x1, x2, x3)[g]
                        v = _nibble_values(word)
                        vals = _join(_join(_join(v[0], v[2]), _join(v[1], v[3])),
                                     _join(_join(v[4], v[6]), _join(v[5], v[7])))
                        a = vals.permute(0, 4, 3, 1, 2).reshape(bn, 32)
                        xg = xq_g.reshape(bm, 4, 2, 2, 2).permute(2, 4, 1, 3, 0).reshape(32, bm)
                        d = a.double() @ xg.double()
                        sw = torch.exp2(scales[ex, n0:n0 + bn, k0 // 32 + g].double() - 127 + 6)  # _e8m0_x64
                        sx = torch.zeros(bm, dtype=torch.float64)
                        sx[:len(block)] = xs[block, k0 // 32 + g].double()
                        acc[n0:n0 + bn] += (d * (sw[:, None] * sx[None, :])).float()
            dense = dequantize_fp4_weight(packed[ex].view(torch.int8), scales[ex].view(torch.float8_e8m0fnu),
                                          torch.float64)
            want = xq[block].double() @ dense.t()
            got = acc[:, :len(block)].t().double()
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-6, f"expert {ex} block at {b0}: rel {rel:.2e}"
    print("emulate: the kernel's steps give the dense product of every block (fp32 accumulation)")


def check_finish():
    """finish.py in Triton's interpreter: the up finish (split sums, SwiGLU, h's QDQ at the permuted positions)
    against torch's SwiGLU and numerics.fp8_act_qdq, the down finish (split sums rounded, placed by pair) exactly."""
    import torch.nn.functional as F
    from finish import down_finish, up_finish
    from fp4_mma import permute_activations
    from modeling_deepseek_v41.kernels.numerics import fp8_act_qdq
    g = torch.Generator().manual_seed(7)
    splits, rows, inter, d, limit = 3, 5, 256, 384, 10.0
    gate, up = (torch.randn(splits, rows, inter, generator=g) * 2 for _ in range(2))
    route = torch.rand(rows, generator=g)
    pair_of_row = torch.randperm(rows, generator=g).to(torch.int32)
    h, hs = up_finish(torch.cat((gate, up), dim=-1), route, pair_of_row, limit, torch.bfloat16)
    gs = (gate[0] + gate[1] + gate[2]).to(torch.bfloat16).float().clamp(max=limit)
    us = (up[0] + up[1] + up[2]).to(torch.bfloat16).float().clamp(-limit, limit)
    want = (route[pair_of_row.long()][:, None] * (F.silu(gs) * us)).to(torch.bfloat16)
    want = permute_activations(fp8_act_qdq(want.float()))
    got = h.float() * permute_activations(hs.repeat_interleave(32, dim=1))
    torch.testing.assert_close(got, want, rtol=0.07, atol=1e-3)  # an e4m3 step where silu rounds otherwise
    assert (got == want).float().mean() > 0.99
    from shared import act_quant_permuted
    xa = torch.randn(rows, d, generator=g).to(torch.bfloat16)
    codes, scales = act_quant_permuted(xa, nibbles=True)
    want_q = permute_activations(fp8_act_qdq(xa.float()))
    assert torch.equal(codes.float() * permute_activations(scales.repeat_interleave(32, dim=1)), want_q)
    part = torch.randn(splits, rows, d, generator=g)
    out = down_finish(part, pair_of_row, torch.bfloat16)
    assert torch.equal(out[pair_of_row.long()], (part[0] + part[1] + part[2]).to(torch.bfloat16))
    print("finish: the up finish matches torch's SwiGLU and QDQ at the permuted positions, the down finish exactly")


def _emulated_fp4_mma(x_codes, x_scales, words, scales, row_token, block_expert, block_start, block_end, k_chunk,
                      bn=128):
    """grouped_fp4_mma's result computed densely from its permuted operands (one split)."""
    from fp4_mma import slice_permutation
    e, n, kw = words.shape
    k = kw * 8
    inverse = torch.argsort(slice_permutation(k))  # natural column -> permuted position
    nib = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(e, n, k)[..., inverse]
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    dense = table[nib.long()] * torch.exp2(scales.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)
    x = x_codes[:, inverse].float() * x_scales.repeat_interleave(32, dim=1)
    rows = row_token.shape[0] if row_token is not None else x_codes.shape[0]
    out = torch.zeros(1, rows, n)
    for b in range(block_expert.shape[0]):
        for r in range(int(block_start[b]), int(block_end[b])):
            out[0, r] = x[int(row_token[r]) if row_token is not None else r] @ dense[int(block_expert[b])].t()
    return out


def check_moe():
    """mma_moe's plumbing (schedule, the rows' tokens, the finishing launches, the combine) in the interpreter,
    the MMA kernel replaced by its dense emulation, against grouped_moe's rows formulation on the same experts."""
    import finish
    from fp4_mma import permute_fp4_words
    from modeling_deepseek_v41.kernels.triton.moe import grouped_moe
    sys.modules["fp4_mma"].grouped_fp4_mma = _emulated_fp4_mma
    g = torch.Generator().manual_seed(11)
    e, d, inter, tokens, top_k = 6, 256, 128, 3, 2
    (p1, s1), (p3, s3), (p2, s2) = (random_packed(e, n, k, seed=i) for i, (n, k) in
                                    enumerate(((inter, d), (inter, d), (d, inter))))
    x = (torch.randn(tokens, d, generator=g)).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    stacks = [t.view(torch.int8) for t in (p1, p3, p2)]
    ref = grouped_moe(x, experts, weights, stacks[0], s1, stacks[1], s3, stacks[2], s2, 10.0)
    got = finish.mma_moe(x, experts, weights, permute_fp4_words(torch.cat((p1, p3), dim=1)), torch.cat((s1, s3), dim=1),
                         permute_fp4_words(p2), s2, 10.0)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    print(f"moe: mma_moe with the kernel emulated matches grouped_moe (rel {rel:.1e}; summation orders differ)")


def check_sass(out):
    import fp4_mma
    from shared import gluon_sass
    types = {"x_ptr": "*fp16", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*fp32",
             "row_token_ptr": "*i32", "block_expert_ptr": "*i32", "block_start_ptr": "*i32", "block_end_ptr": "*i32"}
    const = {"BN": int(os.environ.get("BN", 128)), "WORD_ASM": fp4_mma._FP4_WORD_ASM.value, "ROWS_ARE_TOKENS": False}
    gluon_sass(fp4_mma._fp4_mma_kernel, types, const, out)


def check_gpu():
    import triton
    from fp4_mma import BM, grouped_fp4_mma, permute_activations, permute_fp4_words
    from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight
    from modeling_deepseek_v41.kernels.triton.moe_schedule import moe_schedule
    from modeling_deepseek_v41.kernels.triton.moe_rows import rows_moe
    from modeling_deepseek_v41.kernels.triton.quant import fp8_act_quant
    dev = "cuda"
    torch.manual_seed(0)
    for e, n, k, tokens, top_k in ((8, 2304, 5120, 1, 6), (32, 2304, 5120, 6, 6), (32, 2304, 5120, 32, 6),
                                   (384, 2304, 5120, 32, 6)):
        packed, scales = random_packed(e, n, k, seed=e + tokens)
        words = permute_fp4_words(packed.to(dev))
        scales = scales.to(dev)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        experts = torch.rand(tokens, e, device=dev).topk(top_k, dim=-1).indices
        pair_of_row, block_expert, block_start, block_end, _ = moe_schedule(experts, e, BM.value)
        row_token = (pair_of_row // top_k).to(torch.int32)
        codes, xs = fp8_act_quant(x, torch.float16)
        xp = permute_activations(codes)
        out = grouped_fp4_mma(xp, xs, words, scales, row_token, block_expert, block_start, block_end, 1280)
        got = out.sum(0)
        pairs = pair_of_row.shape[0]
        valid = torch.arange(pairs, device=dev) < tokens * top_k  # rows past the real pairs are not stored
        ids = experts.reshape(-1)[pair_of_row.long().clamp_max(tokens * top_k - 1)]
        xq = codes.float() * xs.repeat_interleave(32, dim=1)
        want = torch.stack([xq[row_token[r].long()] @ dequantize_fp4_weight(
            packed[ids[r].item()].view(torch.int8).to(dev), scales[ids[r].item()].view(torch.float8_e8m0fnu), torch.float32).t()
            for r in range(pairs) if valid[r]])
        rel = ((got[valid] - want).norm() / want.norm()).item()
        ms = triton.testing.do_bench_cudagraph(lambda: grouped_fp4_mma(
            xp, xs, words, scales, row_token, block_expert, block_start, block_end, 1280))
        touched = min(e, tokens * top_k)
        roof = touched * n * k / 2 / 4.8e12 * 1e3
        print(f"E {e} tokens {tokens}: rel {rel:.2e}, {ms * 1e3:.1f} us against {roof * 1e3:.1f} us of bytes "
              f"(one projection)")
        assert rel < 1e-5
        # the whole routed MoE's three projections against the committed rows formulation, same routing
        inter, d = n, k
        (p1, s1), (p3, s3) = random_packed(e, inter, d, seed=1), random_packed(e, inter, d, seed=2)
        p2, s2 = random_packed(e, d, inter, seed=5)
        w1, w3, w2 = (permute_fp4_words(t.to(dev)) for t in (p1, p3, p2))
        s1, s3, s2 = (t.to(dev) for t in (s1, s3, s2))
        h_codes = permute_activations(torch.randint(-64, 64, (tokens * top_k, inter), device=dev).half())
        h_scales = torch.ones(tokens * top_k, inter // 32, device=dev)

        def mma_moe():
            grouped_fp4_mma(xp, xs, w1, s1, row_token, block_expert, block_start, block_end, 1280)
            grouped_fp4_mma(xp, xs, w3, s3, row_token, block_expert, block_start, block_end, 1280)
            grouped_fp4_mma(h_codes, h_scales, w2, s2, None, block_expert, block_start, block_end, 1152)

        schedule = moe_schedule(experts, e, 16)[:4]
        route = torch.rand(tokens * top_k, device=dev)
        d1, d3, d2 = (t.to(dev).view(torch.int8) for t in (p1, p3, p2))
        rows_ms = triton.testing.do_bench_cudagraph(lambda: rows_moe(
            x, route, schedule, d1, s1, d3, s3, d2, s2, 10.0, top_k, ieee=False))
        mma_ms = triton.testing.do_bench_cudagraph(mma_moe)
        print(f"  three projections: rows formulation {rows_ms * 1e3:.1f} us (with its QDQ, SwiGLU, schedule), "
              f"the MMA kernel's three launches {mma_ms * 1e3:.1f} us (without them), bytes {3 * roof * 1e3:.1f} us")
        # end to end: the routed sum through the MMA kernel and its finishing launches against grouped_moe's
        from finish import mma_moe
        from modeling_deepseek_v41.kernels.triton.moe import grouped_moe
        weights = torch.rand(tokens, top_k, device=dev)
        ref = grouped_moe(x, experts, weights, d1, s1, d3, s3, d2, s2, 10.0)
        w13 = permute_fp4_words(torch.cat((p1, p3), dim=1).to(dev))
        s13 = torch.cat((s1, s3), dim=1)
        got = mma_moe(x, experts, weights, w13, s13, w2, s2, 10.0)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        end_ms = triton.testing.do_bench_cudagraph(lambda: mma_moe(x, experts, weights, w13, s13, w2, s2, 10.0))
        ref_ms = triton.testing.do_bench_cudagraph(lambda: grouped_moe(x, experts, weights, d1, s1, d3, s3, d2, s2,
                                                                       10.0))
        print(f"  routed sum: MMA {end_ms * 1e3:.1f} us against grouped_moe {ref_ms * 1e3:.1f} us, rel {rel:.2e} "
              f"(summation orders differ; a bf16 rounding of h may flip an e4m3 step)")
        assert rel < 2e-2


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "layout"
    if what == "layout":
        check_layout()
    elif what == "emulate":
        check_emulate()
    elif what == "finish":
        check_finish()
    elif what == "moe":
        check_moe()
    elif what == "sass":
        check_sass(sys.argv[2])
    else:
        check_gpu()
