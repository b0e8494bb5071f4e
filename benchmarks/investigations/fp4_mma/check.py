"""Checks of the candidate FP4 MMA formulation (fp4_mma.py).

    python check.py layout          # CPU: the load-time permutation puts each column where the kernel reads it
    python check.py emulate         # CPU: the kernel's steps (splits, joins, permutes, reshapes) in torch
    python check.py sass out.sass   # CPU: compile for sm_90 with the Triton 3.6 wheel in /tmp/t36, loop mix
    python check.py gpu             # GPU: both orders against the dequantized product, their times; the rows
                                    # formulation and the package's tensor-core MoE (moe_mma.py) beside them
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


def random_packed(e, n, k, seed=0, device="cpu"):
    g = torch.Generator(device).manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8, device=device)
    scales = torch.randint(118, 128, (e, n, k // 32), generator=g, dtype=torch.uint8, device=device)
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
    from fp4_mma import BM, grouped_fp4_mma
    from modeling_deepseek_v41.kernels.numerics import dequantize_fp4_weight, fp8_act_qdq
    from modeling_deepseek_v41.kernels.triton.moe import grouped_moe
    from modeling_deepseek_v41.kernels.triton.moe_schedule import moe_schedule
    from shared import act_quant_permuted
    dev = "cuda"
    torch.manual_seed(0)
    for e, n, k, tokens, top_k in ((8, 2304, 5120, 1, 6), (32, 2304, 5120, 6, 6), (32, 2304, 5120, 32, 6),
                                   (384, 2304, 5120, 32, 6)):
        packed, scales = random_packed(e, n, k, seed=e + tokens, device=dev)
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
        # the whole routed MoE: the rows formulation against the package's tensor-core formulation (which runs
        # this kernel's natural order), the same routing
        stacks = []
        for rows_, cols, seed in ((n, k, 1), (n, k, 2), (k, n, 5)):  # w1, w3 [E, I, D/2], w2 [E, D, I/2]
            w, sc = random_packed(e, rows_, cols, seed=seed, device=dev)
            stacks += [w.view(torch.int8), sc]
        weights = torch.rand(tokens, top_k, device=dev)
        line = f"  routed sum: bytes {3 * roof:.1f} us"
        for name, flag in (("rows", {"rows": True}), ("moe_mma", {"mma": True})):
            us = triton.testing.do_bench_cudagraph(lambda: grouped_moe(x, experts, weights, *stacks, 10.0,
                                                                       **flag)) * 1e3
            line += f"; {name} {us:.1f} us"
        print(line, flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "layout"
    if what == "layout":
        check_layout()
    elif what == "emulate":
        check_emulate()
    elif what == "sass":
        check_sass(sys.argv[2])
    else:
        check_gpu()
