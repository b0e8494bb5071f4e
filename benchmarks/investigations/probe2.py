"""Probe 2 (not committed): every distinct linear of the released-width model timed alone, and read patterns."""
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "investigations"))
from probe_linear import graph_us  # noqa: E402

HBM = 4.8e12


@triton.jit
def _bw2_kernel(w_ptr, out_ptr, k_chunk, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.full([BN, BK], 0, tl.int32)
    k0 = pid_s * k_chunk
    for k in range(k0, k0 + k_chunk, BK):
        acc ^= tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + offs_k)[None, :])
    tl.store(out_ptr + pid_s * 0 + offs_n, tl.sum(acc, 1))


@triton.jit
def _flat_kernel(w_ptr, out_ptr, chunk, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0, tl.int32)
    base = pid * chunk
    for i in range(base, base + chunk, BLOCK):
        acc ^= tl.load(w_ptr + i + offs)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


@triton.jit
def _gemv32_kernel(x_ptr, w_ptr, out_ptr, part_ptr, N, K, k_chunk, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 GEMV, one row: CUDA-core FMAs, partials per split."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.full([BN, BK], 0.0, tl.float32)
    k0 = pid_s * k_chunk
    for k in range(k0, k0 + k_chunk, BK):
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + offs_k)[None, :], mask=(offs_n < N)[:, None], other=0.)
        x = tl.load(x_ptr + k + offs_k)
        acc += w * x[None, :]
    tl.store(part_ptr + pid_s * N + offs_n, tl.sum(acc, 1), mask=offs_n < N)


def read_patterns():
    print("\n== read patterns (42 MB fp8 5120x8192, 6 copies; roofline 8.7 us)", flush=True)
    n, k = 5120, 8192
    ws = [torch.randint(0, 255, (n, k // 4), device="cuda", dtype=torch.int32) for _ in range(6)]
    res = []
    for bn, bk4, splits, warps, stages in [(8, 256, 8, 4, 3), (16, 256, 4, 4, 3), (16, 128, 8, 4, 4),
                                           (32, 128, 4, 8, 3), (8, 512, 4, 8, 2), (4, 512, 8, 4, 3),
                                           (16, 256, 8, 8, 3), (32, 64, 8, 4, 4), (64, 64, 4, 8, 3)]:
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        kc = (k // 4) // splits
        try:
            us = graph_us([lambda w=w: _bw2_kernel[(n // bn, splits)](w, out, kc, w.stride(0), BN=bn, BK=bk4,
                                                                      num_warps=warps, num_stages=stages) for w in ws])
            res.append((us, f"tile BN{bn} BKbytes{bk4 * 4} splits{splits} w{warps} s{stages} progs{n // bn * splits}"))
        except Exception as e:
            print("fail", bn, bk4, type(e).__name__, str(e)[:150], flush=True)
    flat = [w.view(-1) for w in ws]
    total = flat[0].numel()
    for progs, block, warps in [(132, 1024, 4), (264, 1024, 4), (528, 1024, 8), (1056, 512, 4), (264, 2048, 8)]:
        chunk = total // progs // block * block
        out = torch.empty(progs * block, dtype=torch.int32, device="cuda")
        us = graph_us([lambda w=w: _flat_kernel[(progs,)](w, out, chunk, BLOCK=block, num_warps=warps) for w in flat])
        frac = chunk * progs / total
        res.append((us / frac, f"flat progs{progs} block{block * 4}B w{warps} (scaled)"))
    a = torch.empty(n * k, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    res.append((graph_us([lambda: b.copy_(a)]) / 2, "torch copy 42MB (read+write)/2"))
    for us, label in sorted(res):
        print(f"  {label:<60} {us:7.1f} us  {8.7 / us * 100:4.0f}%", flush=True)


def head_variants():
    print("\n== fp32 head 129280x5120 (2.65 GB; roofline 552 us)", flush=True)
    from modeling_deepseek_v41.kernels.triton.linear import dense_linear
    n, k = 129280, 5120
    w = torch.randn(n, k, device="cuda")
    for m in (1, 32):
        x = torch.randn(m, k, device="cuda")
        print(f"  dense_linear M={m}: {graph_us([lambda: dense_linear(x, w)], reps=5):.0f} us", flush=True)
        print(f"  torch F.linear fp32 M={m}: {graph_us([lambda: torch.nn.functional.linear(x, w)], reps=5):.0f} us",
              flush=True)
    x = torch.randn(1, k, device="cuda")
    for bn, bk, splits, warps in [(16, 256, 1, 4), (32, 128, 2, 4), (8, 512, 1, 4), (16, 512, 2, 8)]:
        part = torch.empty(splits, n, device="cuda")
        try:
            us = graph_us([lambda: _gemv32_kernel[(triton.cdiv(n, bn), splits)](x, w, part, part, n, k, k // splits,
                                                                                w.stride(0), BN=bn, BK=bk,
                                                                                num_warps=warps)], reps=5)
            print(f"  gemv32 BN{bn} BK{bk} splits{splits} w{warps}: {us:.0f} us", flush=True)
        except Exception as e:
            print("fail", bn, type(e).__name__, str(e)[:150], flush=True)
    del w


def model_linears():
    from realwidth import build, released_config
    from modeling_deepseek_v41.kernels.linear import DeepseekV41Weight
    model = build(released_config("quantized", 32, 1 << 20))
    groups = {}
    for name, mod in model.named_modules():
        if isinstance(mod, DeepseekV41Weight) and ".experts." not in name:
            key = (".".join(p for p in name.split(".") if not p.isdigit()), tuple(mod.weight.shape), mod.storage,
                   str(mod.weight.dtype))
            groups.setdefault(key, []).append(mod)
    print("\n== the model's linears, each alone (graph of up to 8 modules of the same kind), us per call", flush=True)
    total = {1: 0.0, 32: 0.0}
    with torch.no_grad():
        for key, mods in sorted(groups.items()):
            name, shape, storage, dtype = key
            mod = mods[0]
            nbytes = mod.weight.numel() * mod.weight.element_size()
            line = f"  {len(mods):>3} x {name:<44} {str(shape):<16} {storage:<5} {dtype[6:]:<14}"
            for m in (1, 32):
                if type(mod).__name__ == "DeepseekV41Weight":
                    g = model.config.text_config.o_groups
                    x = torch.randn(1, m, g, mod.in_features // g, device="cuda", dtype=torch.bfloat16)
                    calls = [lambda mm=mm: mm.grouped(x) for mm in mods[:8]]
                else:
                    x = torch.randn(1, m, mod.in_features, device="cuda", dtype=torch.bfloat16)
                    calls = [lambda mm=mm: mm(x) for mm in mods[:8]]
                us = graph_us(calls, reps=7)
                total[m] += us * len(mods)
                line += f"  M={m} {us:7.1f} us ({nbytes / HBM * 1e6 / us * 100:3.0f}%)"
            print(line, flush=True)
    print(f"  sum over the model's linears (M=1 / M=32): {total[1] / 1e3:.2f} / {total[32] / 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    for f in (model_linears, read_patterns, head_variants):
        try:
            f()
        except Exception as e:
            import traceback
            traceback.print_exc()
        print(f"[{time.time() - t0:.0f} s]", flush=True)
