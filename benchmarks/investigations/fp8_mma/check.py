"""Checks of the candidate FP8 MMA linear (fp8_mma.py).

    python check.py layout          # CPU: in both orders each byte is where the kernel's lanes read it
    python check.py emulate         # CPU: the kernel's steps in torch against the dense product
    python check.py patch           # CPU (interpreter): patch.py's plumbing, the kernel emulated, against rows_linear
    python check.py sass out.sass   # CPU: compile for sm_90 with the Triton 3.6 wheel in /tmp/t36, loop mix
    python check.py gpu             # H200: against the dense product; time against the rows kernel
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


def _random(n, k, m, seed):
    from modeling_deepseek_v41.kernels import numerics
    g = torch.Generator().manual_seed(seed)
    w, s = numerics.quantize_fp8_weight(torch.randn(n, k, generator=g) * 0.02)
    x = numerics.fp8_act_qdq(torch.randn(m, k, generator=g))
    xs = torch.exp2(torch.ceil(torch.log2(x.view(m, -1, 32).abs().amax(-1).clamp_min(1e-4) / 448)))
    codes = (x.view(m, -1, 32) / xs[..., None]).view(m, k)
    return w, s, x, codes, xs


ORDERS = (True, False)  # natural (the shipped bytes), then permuted copies


def check_layout():
    from fp8_mma import act_quant_permuted, natural_fp8_rows, permute_fp8_rows, word_index
    from modeling_deepseek_v41.kernels import numerics
    from shared import FP8_BYTES, NATURAL, lane_columns, permuted_columns
    n, k = 4, 256
    w = torch.arange(n * k, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, k)
    xa = torch.randn(3, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for natural in ORDERS:
        order = NATURAL if natural else FP8_BYTES
        words = (natural_fp8_rows if natural else permute_fp8_rows)(w.view(torch.float8_e4m3fn))
        b = words.view(torch.uint8).view(n, k)
        cols = lane_columns(order)
        x = permuted_columns(torch.arange(k, dtype=torch.float32).expand(2, k), order)
        for s in range(k // 128):
            for t in range(4):
                for g in range(4):
                    for i in range(8):  # byte i of lane t: byte i % 4 of word (t, g, i // 4)
                        at = 128 * s + 4 * word_index(t, g, i // 4, natural) + i % 4
                        column = 128 * s + 32 * g + cols[t, i]
                        assert torch.equal(b[:, at], w[:, column]), (natural, s, t, g, i)
                        assert x[0, 128 * s + 32 * t + 8 * g + i] == column  # the kernel's x offsets
        q, sc = act_quant_permuted(xa, natural)
        assert torch.equal(q.float() * permuted_columns(sc.repeat_interleave(32, dim=1), order),
                           permuted_columns(numerics.fp8_act_qdq(xa.float()), order))
    print("layout: in both orders every byte and activation is where the kernel's lanes read it; the QDQ is exact")


def check_emulate():
    for natural in ORDERS:
        _emulate(natural)


def _emulate(natural):
    """The kernel's steps (splits, joins, permutes, reshapes; the dot as a matmul) in torch."""
    from fp8_mma import natural_fp8_rows, permute_fp8_rows
    from modeling_deepseek_v41.kernels import numerics
    from shared import FP8_BYTES, NATURAL, permuted_columns
    n, k, m, bn, bm = 256, 384, 3, 128, 8
    w, s, x, codes, xs = _random(n, k, m, seed=1)
    words = (natural_fp8_rows if natural else permute_fp8_rows)(w)
    xp = permuted_columns(codes, NATURAL if natural else FP8_BYTES)
    out = torch.zeros(n, bm, dtype=torch.float64)
    for n0 in range(0, n, bn):
        for k0 in range(0, k, 128):
            wd = words[n0:n0 + bn, k0 // 4:k0 // 4 + 32]
            wd = wd.view(bn, 4, 4, 2).transpose(1, 2) if natural else wd.view(bn, 4, 4, 2)  # [BN, t, g, h]
            lo, hi = wd.unbind(-1)
            lo02, lo13 = lo.view(bn, 4, 2, 2).unbind(-1)
            lo0, lo2 = lo02.unbind(-1)
            lo1, lo3 = lo13.unbind(-1)
            hi02, hi13 = hi.view(bn, 4, 2, 2).unbind(-1)
            hi0, hi2 = hi02.unbind(-1)
            hi1, hi3 = hi13.unbind(-1)
            xs4 = torch.zeros(bm, 4, 4, 8)
            xs4[:m] = xp[:, k0:k0 + 128].float().view(m, 4, 4, 8)
            x_even, x_odd = xs4.view(bm, 4, 2, 2, 8).permute(0, 1, 2, 4, 3).unbind(-1)
            x0, x2 = x_even.permute(0, 1, 3, 2).unbind(-1)
            x1, x3 = x_odd.permute(0, 1, 3, 2).unbind(-1)
            for g in range(4):
                w01, w23, xq = (lo0, lo1, lo2, lo3)[g], (hi0, hi1, hi2, hi3)[g], (x0, x1, x2, x3)[g]
                v = [((word.contiguous().view(torch.uint8).view(*word.shape, 4)[..., j]).view(torch.float8_e4m3fn)
                      .float()) for word in (w01, w23) for j in range(4)]
                join = lambda a, b: torch.stack((a, b), dim=-1)  # noqa: E731
                vals = join(join(join(v[0], v[1]), join(v[2], v[3])), join(join(v[4], v[5]), join(v[6], v[7])))
                a = vals.permute(0, 4, 3, 1, 2).reshape(bn, 32).double()
                xg = xq.reshape(bm, 4, 2, 2, 2).permute(2, 3, 1, 4, 0).reshape(32, bm).double()
                sw = torch.exp2(s.view(torch.uint8)[(torch.arange(n0, n0 + bn) // 32), k0 // 32 + g].double() - 127)
                sx = torch.zeros(bm, dtype=torch.float64)
                sx[:m] = xs[:, k0 // 32 + g].double()
                out[n0:n0 + bn] += (a @ xg) * (sw[:, None] * sx[None, :])
    want = x.double() @ numerics.dequantize_fp8_weight(w, s).double().t()
    rel = ((out[:, :m].t() - want).norm() / want.norm()).item()
    assert rel < 1e-12, rel
    print(f"emulate ({'natural' if natural else 'permuted'}): the kernel's steps give the dense product "
          f"(rel {rel:.1e})")


def _emulated_linear(codes, xs, words, scales, out_dtype, second=None, split_target=528, natural=True):
    """fp8_mma_linear's result computed densely from its operands in either order."""
    from modeling_deepseek_v41.kernels import numerics
    from shared import FP8_BYTES, NATURAL, slice_permutation

    def one(words, scales):
        n, kw = words.shape
        inverse = torch.argsort(slice_permutation(kw * 4, NATURAL if natural else FP8_BYTES))
        w = words.view(torch.uint8).view(n, kw * 4)
        w = (w if natural else w[:, inverse]).view(torch.float8_e4m3fn)
        x = codes[:, inverse].float() * xs.repeat_interleave(32, dim=1)
        return (x @ numerics.dequantize_fp8_weight(w, scales).float().t()).to(out_dtype)
    return one(words, scales) if second is None else (one(words, scales), one(*second))


def check_patch():
    """patch.py's rows_linear (one weight, a pair; raw rows and QDQ'd ones) with the kernel emulated, in the
    interpreter, against the model's rows_linear: the same values up to fp32 summation order."""
    os.environ["TRITON_INTERPRET"] = "1"
    import fp8_mma
    import patch
    from modeling_deepseek_v41.kernels.triton import linear
    original = linear.rows_linear
    fp8_mma.fp8_mma_linear = _emulated_linear
    for natural in ORDERS:
        _patched(patch, linear, original, natural)
    print("patch: the patched rows_linear gives the model's values (one weight, a pair; both orders)")


def _patched(patch, linear, original, natural):
    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE
    patch.use_mma_linears(natural)
    try:
        n, k = 96, 256
        w, s, _, _, _ = _random(n, k, 1, seed=3)
        w2, s2, _, _, _ = _random(64, k, 1, seed=4)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        want = original(x, w, s, FMT_FP8_TILE, n, k, torch.float32, quantize=True)
        got = linear.rows_linear(x, w, s, FMT_FP8_TILE, n, k, torch.float32, quantize=True)
        assert ((got - want).norm() / want.norm()).item() < 1e-6
        a, b = linear.rows_linear(x, w, s, FMT_FP8_TILE, n, k, torch.float32, second=(w2, s2, 64), quantize=True)
        a0, b0 = original(x, w, s, FMT_FP8_TILE, n, k, torch.float32, second=(w2, s2, 64), quantize=True)
        assert ((a - a0).norm() / a0.norm()).item() < 1e-6 and ((b - b0).norm() / b0.norm()).item() < 1e-6
    finally:
        linear.rows_linear = original


def check_sass(out):
    import fp8_mma
    from shared import gluon_sass
    types = {"x_ptr": "*fp16", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16",
             "part_ptr": "*fp32", "count_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8", "out2_ptr": "*bf16"}
    const = {"BN": 128, "ASM": fp8_mma._BYTES_ASM.value, "NATURAL": os.environ.get("ORDER", "natural") == "natural"}
    gluon_sass(fp8_mma._fp8_mma_kernel, types, const, out)


def check_gpu():
    import triton
    from fp8_mma import act_quant_permuted, fp8_mma_linear, natural_fp8_rows, permute_fp8_rows
    from modeling_deepseek_v41.kernels import numerics
    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE
    from modeling_deepseek_v41.kernels.triton.linear_rows import rows_linear
    shapes = [("wq_a", 1024, 5120), ("wq_b", 32768, 1024), ("wo_b", 5120, 8192), ("shared_w2", 5120, 2304)]
    for name, n, k in shapes:
        for m in (1, 6):
            w, s, x, _, _ = _random(n, k, m, seed=n + m)
            w, s, x = w.cuda(), s.cuda(), x.to(torch.bfloat16).cuda()
            want = x.double() @ numerics.dequantize_fp8_weight(w, s).double().t()  # x is QDQ'd already
            rows_ms = triton.testing.do_bench_cudagraph(lambda: rows_linear(x, w, s, FMT_FP8_TILE, n, k,
                                                                            torch.bfloat16, quantize=True))
            line = f"{name} ({n} x {k}) rows {m}: rows kernel {rows_ms * 1e3:.1f} us"
            for natural in ORDERS:
                words = (natural_fp8_rows if natural else permute_fp8_rows)(w)
                xp, xs = act_quant_permuted(x, natural)
                got = fp8_mma_linear(xp, xs, words, s, torch.float32, natural=natural)
                rel = ((got.double() - want).norm() / want.norm()).item()
                ms = triton.testing.do_bench_cudagraph(lambda: fp8_mma_linear(xp, xs, words, s, torch.bfloat16,
                                                                              natural=natural))
                line += f"; MMA {'natural' if natural else 'permuted'} {ms * 1e3:.1f} us (rel {rel:.1e})"
                assert rel < 1e-5, line
                if m == 6:  # a row's result does not depend on the other rows
                    one = fp8_mma_linear(xp[:1], xs[:1], words, s, torch.float32, natural=natural)
                    assert torch.equal(one, got[:1]), line
            print(line + f"; bytes {n * k / 4.8e12 * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "layout"
    checks = {"layout": check_layout, "emulate": check_emulate, "patch": check_patch, "gpu": check_gpu}
    checks.get(what, lambda: check_sass(sys.argv[2]))()
