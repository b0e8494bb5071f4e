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


ORDERS = (True, False)  # natural (the shipped bytes), then permuted stacks


def _words(packed, natural):
    from fp4_mma import natural_fp4_words, permute_fp4_words
    return natural_fp4_words(packed) if natural else permute_fp4_words(packed)


def _order(natural):
    from shared import FP4_WORDS, NATURAL
    return NATURAL if natural else FP4_WORDS


def check_layout():
    from fp4_mma import word_index
    from shared import lane_columns, permuted_columns
    e, n, k = 2, 8, 256
    packed, _ = random_packed(e, n, k)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [e, n, k] column order
    for natural in ORDERS:
        words = _words(packed, natural)  # [e, n, k/8] int32
        nib = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)  # [e, n, k/8, 8]
        cols = lane_columns(_order(natural))
        x = permuted_columns(torch.arange(k, dtype=torch.float32).expand(2, k), _order(natural))
        for s in range(k // 128):  # lane t's word of group g: its nibble i is column 32 g + cols[t, i]
            for g in range(4):
                for t in range(4):
                    for i in range(8):
                        column = 128 * s + 32 * g + cols[t, i]
                        assert torch.equal(nib[:, :, 16 * s + word_index(t, g, natural), i].to(torch.uint8),
                                           codes[:, :, column]), (natural, s, g, t, i)
                        assert x[0, 128 * s + 32 * t + 8 * g + i] == column  # the kernel's x offsets
        assert sorted(cols.reshape(-1).tolist()) == list(range(32))
    print("layout: in both orders every column of every group is where the kernel's lanes read it")


def _nibble_values(word):
    """fp4_word_nibbles' eight outputs (nibble i as its e2m1 value x 2^-6) in torch."""
    from modeling_deepseek_v41.kernels.numerics import fp4_dequantize_rows  # noqa: F401  (the package imports)
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]) / 64
    return [table[((word >> (4 * i)) & 15).long()] for i in range(8)]


def _join(a, b):
    return torch.stack((a, b), dim=-1)  # gl.join: the pair on a new last axis


def check_emulate():
    for natural in ORDERS:
        _emulate(natural)


def _emulate(natural):
    """The Gluon kernel's per-program steps in torch (gl.join/split/permute/reshape have torch's semantics), over a
    schedule's blocks, against the dense product of the QDQ'd activations and the dequantized experts."""
    from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight, fp8_act_qdq
    from shared import permuted_columns
    e, n, k, tokens, top_k, bn, bm = 4, 256, 512, 5, 2, 128, 8
    packed, scales = random_packed(e, n, k, seed=3)
    words = _words(packed, natural)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(4))
    xq = fp8_act_qdq(x)
    xs = (xq.view(tokens, -1, 32).abs().amax(-1).clamp_min(1e-30))  # any per-group power of two works: use QDQ's
    xs = torch.exp2(torch.ceil(torch.log2(xs / 448)))
    codes = (xq.view(tokens, -1, 32) / xs[..., None]).view(tokens, k)
    xp = permuted_columns(codes, _order(natural))
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
                    wds = words[ex, n0:n0 + bn, k0 // 8:k0 // 8 + 16].view(bn, 4, 4)
                    wds = wds.transpose(1, 2) if natural else wds  # [BN, t, g]
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
    print(f"emulate ({'natural' if natural else 'permuted'}): the kernel's steps give the dense product of every "
          "block (fp32 accumulation)")


def check_finish():
    """finish.py in Triton's interpreter: the up finish (split sums, SwiGLU, h's QDQ at the permuted positions)
    against torch's SwiGLU and numerics.fp8_act_qdq, the down finish (split sums rounded, placed by pair) exactly."""
    import torch.nn.functional as F
    from finish import down_finish, up_finish
    from modeling_deepseek_v41.kernels.numerics import fp8_act_qdq
    from shared import act_quant_permuted, permuted_columns
    g = torch.Generator().manual_seed(7)
    splits, rows, inter, d, limit = 3, 5, 256, 384, 10.0
    gate, up = (torch.randn(splits, rows, inter, generator=g) * 2 for _ in range(2))
    route = torch.rand(rows, generator=g)
    pair_of_row = torch.randperm(rows, generator=g).to(torch.int32)
    gs = (gate[0] + gate[1] + gate[2]).to(torch.bfloat16).float().clamp(max=limit)
    us = (up[0] + up[1] + up[2]).to(torch.bfloat16).float().clamp(-limit, limit)
    swiglu = (route[pair_of_row.long()][:, None] * (F.silu(gs) * us)).to(torch.bfloat16)
    xa = torch.randn(rows, d, generator=g).to(torch.bfloat16)
    for natural in ORDERS:
        order = _order(natural)
        h, hs = up_finish(torch.cat((gate, up), dim=-1), route, pair_of_row, limit, torch.bfloat16, order)
        want = permuted_columns(fp8_act_qdq(swiglu.float()), order)
        got = h.float() * permuted_columns(hs.repeat_interleave(32, dim=1), order)
        torch.testing.assert_close(got, want, rtol=0.07, atol=1e-3)  # an e4m3 step where silu rounds otherwise
        assert (got == want).float().mean() > 0.99
        codes, scales = act_quant_permuted(xa, order)
        want_q = permuted_columns(fp8_act_qdq(xa.float()), order)
        assert torch.equal(codes.float() * permuted_columns(scales.repeat_interleave(32, dim=1), order), want_q)
    part = torch.randn(splits, rows, d, generator=g)
    out = down_finish(part, pair_of_row, torch.bfloat16)
    assert torch.equal(out[pair_of_row.long()], (part[0] + part[1] + part[2]).to(torch.bfloat16))
    print("finish: the up finish matches torch's SwiGLU and QDQ at both orders' positions, the down finish exactly")


def _emulated_fp4_mma(x_codes, x_scales, words, scales, row_token, block_expert, block_start, block_end, k_chunk,
                      second=None, natural=True, bn=128):
    """grouped_fp4_mma's result computed densely from its operands in either order (one split)."""
    from shared import slice_permutation
    if second is not None:
        return torch.cat([_emulated_fp4_mma(x_codes, x_scales, w, s, row_token, block_expert, block_start, block_end,
                                            k_chunk, natural=natural) for w, s in ((words, scales), second)], dim=-1)
    e, n, kw = words.shape
    k = kw * 8
    inverse = torch.argsort(slice_permutation(k, _order(natural)))  # column -> its position
    nib = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(e, n, k)
    nib = nib if natural else nib[..., inverse]
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
    import fp4_mma
    from modeling_deepseek_v41.kernels.triton.moe import grouped_moe
    fp4_mma.grouped_fp4_mma = _emulated_fp4_mma
    g = torch.Generator().manual_seed(11)
    e, d, inter, tokens, top_k = 6, 256, 128, 3, 2
    (p1, s1), (p3, s3), (p2, s2) = (random_packed(e, n, k, seed=i) for i, (n, k) in
                                    enumerate(((inter, d), (inter, d), (d, inter))))
    x = (torch.randn(tokens, d, generator=g)).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    stacks = [t.view(torch.int8) for t in (p1, p3, p2)]
    ref = grouped_moe(x, experts, weights, stacks[0], s1, stacks[1], s3, stacks[2], s2, 10.0)
    for natural in ORDERS:
        got = finish.mma_moe(x, experts, weights, _words(p1, natural), s1, _words(p3, natural), s3, _words(p2, natural),
                             s2, 10.0, natural=natural)
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel
        print(f"moe ({'natural' if natural else 'permuted'}): mma_moe with the kernel emulated matches grouped_moe "
              f"(rel {rel:.1e}; summation orders differ)")


def check_sass(out):
    import fp4_mma
    from shared import gluon_sass
    types = {"x_ptr": "*fp16", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*fp32",
             "row_token_ptr": "*i32", "block_expert_ptr": "*i32", "block_start_ptr": "*i32", "block_end_ptr": "*i32"}
    types.update({"w2_ptr": "*i32", "s2_ptr": "*u8"})
    const = {"BN": int(os.environ.get("BN", 128)), "WORD_ASM": fp4_mma._FP4_WORD_ASM.value, "ROWS_ARE_TOKENS": False,
             "NATURAL": os.environ.get("ORDER", "natural") == "natural"}
    gluon_sass(fp4_mma._fp4_mma_kernel, types, const, out)


def check_gpu():
    import triton
    from finish import mma_moe
    from fp4_mma import BM, grouped_fp4_mma
    from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight, fp8_act_qdq
    from modeling_deepseek_v41.kernels.triton.moe import grouped_moe
    from modeling_deepseek_v41.kernels.triton.moe_rows import rows_moe
    from modeling_deepseek_v41.kernels.triton.moe_schedule import moe_schedule
    from shared import act_quant_permuted
    dev = "cuda"
    torch.manual_seed(0)
    for e, n, k, tokens, top_k in ((8, 2304, 5120, 1, 6), (32, 2304, 5120, 6, 6), (32, 2304, 5120, 32, 6),
                                   (384, 2304, 5120, 32, 6)):
        packed, scales = random_packed(e, n, k, seed=e + tokens)
        packed, scales = packed.to(dev), scales.to(dev)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        experts = torch.rand(tokens, e, device=dev).topk(top_k, dim=-1).indices
        pair_of_row, block_expert, block_start, block_end, _ = moe_schedule(experts, e, BM.value)
        blocks = (block_expert, block_start, block_end)
        row_token = (pair_of_row // top_k).to(torch.int32)
        pairs = pair_of_row.shape[0]
        valid = torch.arange(pairs, device=dev) < tokens * top_k  # rows past the real pairs are not stored
        ids = experts.reshape(-1)[pair_of_row.long().clamp_max(tokens * top_k - 1)]
        xq = fp8_act_qdq(x.float())
        touched = min(e, tokens * top_k)
        roof = touched * n * k / 2 / 4.8e12 * 1e6
        line = f"E {e} tokens {tokens} (one projection; bytes {roof:.1f} us)"
        for natural in ORDERS:
            words = _words(packed, natural)
            xp, xs = act_quant_permuted(x, _order(natural))
            got = grouped_fp4_mma(xp, xs, words, scales, row_token, *blocks, 1280, natural=natural).sum(0)
            want = torch.stack([xq[row_token[r].long()] @ dequantize_fp4_weight(
                packed[ids[r].item()].view(torch.int8), scales[ids[r].item()].view(torch.float8_e8m0fnu),
                torch.float32).t() for r in range(pairs) if valid[r]])
            rel = ((got[valid] - want).norm() / want.norm()).item()
            us = triton.testing.do_bench_cudagraph(lambda: grouped_fp4_mma(
                xp, xs, words, scales, row_token, *blocks, 1280, natural=natural)) * 1e3
            line += f"; {'natural' if natural else 'permuted'} {us:.1f} us (rel {rel:.1e})"
            assert rel < 1e-5, line
        print(line, flush=True)
        # the whole routed MoE: the rows formulation's three projections, the MMA kernel's (w1 and w3 in one
        # launch), and end to end (QDQ, SwiGLU, schedule and combine included) against grouped_moe
        inter, d = n, k
        (p1, s1), (p3, s3) = random_packed(e, inter, d, seed=1), random_packed(e, inter, d, seed=2)
        p2, s2 = random_packed(e, d, inter, seed=5)
        d1, d3, d2 = (t.to(dev).view(torch.int8) for t in (p1, p3, p2))
        s1, s3, s2 = (t.to(dev) for t in (s1, s3, s2))
        schedule = moe_schedule(experts, e, 16)[:4]
        route = torch.rand(tokens * top_k, device=dev)
        rows_us = triton.testing.do_bench_cudagraph(lambda: rows_moe(
            x, route, schedule, d1, s1, d3, s3, d2, s2, 10.0, top_k, ieee=False)) * 1e3
        weights = torch.rand(tokens, top_k, device=dev)
        ref = grouped_moe(x, experts, weights, d1, s1, d3, s3, d2, s2, 10.0)
        ref_us = triton.testing.do_bench_cudagraph(lambda: grouped_moe(x, experts, weights, d1, s1, d3, s3, d2, s2,
                                                                       10.0)) * 1e3
        line = (f"  routed sum: rows formulation {rows_us:.1f} us, grouped_moe {ref_us:.1f} us, bytes "
                f"{3 * roof:.1f} us")
        for natural in ORDERS:
            w1, w3, w2 = (_words(t, natural) for t in (d1, d3, d2))
            xp, xs = act_quant_permuted(x, _order(natural))
            h = torch.randint(-64, 64, (pairs, inter), device=dev).half()
            hs = torch.ones(pairs, inter // 32, device=dev)

            def projections():
                grouped_fp4_mma(xp, xs, w1, s1, row_token, *blocks, 1280, second=(w3, s3), natural=natural)
                grouped_fp4_mma(h, hs, w2, s2, None, *blocks, 1152, natural=natural)

            proj_us = triton.testing.do_bench_cudagraph(projections) * 1e3
            got = mma_moe(x, experts, weights, w1, s1, w3, s3, w2, s2, 10.0, natural=natural)
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            end_us = triton.testing.do_bench_cudagraph(lambda: mma_moe(x, experts, weights, w1, s1, w3, s3, w2, s2,
                                                                       10.0, natural=natural)) * 1e3
            line += (f"; MMA {'natural' if natural else 'permuted'}: projections {proj_us:.1f} us, end to end "
                     f"{end_us:.1f} us (rel {rel:.1e})")
            assert rel < 2e-2, line  # summation orders differ; a bf16 rounding of h may flip an e4m3 step
        print(line, flush=True)


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
