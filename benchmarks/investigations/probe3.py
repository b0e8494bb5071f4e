"""Probe 3 (not committed): scaled dots against the dequantized tiles / fp16 slices, the fp32 head's tile, the
model's linears one by one."""
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "investigations"))
from probe_linear import graph_us, rand_fp8  # noqa: E402
from triton_kernels import random_fp4  # noqa: E402

from modeling_deepseek_v41.kernels.triton import linear as lin  # noqa: E402
from modeling_deepseek_v41.kernels.triton import fp8_linear, grouped_moe, dense_linear  # noqa: E402

HBM = 4.8e12


def linears_ab():
    print("== FP8 linears: scaled dots vs dequantized tiles (us per call; roofline)", flush=True)
    for name, n, k in [("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("wq_a", 1280, 5120), ("shared_w1", 2304, 5120),
                       ("wq_a+wkv", 1792, 5120), ("shared_w13", 4608, 5120)]:
        copies = max(2, min(12, math.ceil(240e6 / (n * k))))
        ws = [rand_fp8(n, k, "cuda") for _ in range(copies)]
        line = f"  {name:<11} {n}x{k} roof {n * k / HBM * 1e6:5.1f}"
        for m in (1, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for scaled in (False, True):
                lin.SCALED_DOTS = scaled
                us = graph_us([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in ws])
                line += f"  M={m} {'scaled' if scaled else 'tiles '} {us:6.1f}"
        print(line, flush=True)
        del ws
    lin.SCALED_DOTS = True


def moe_ab():
    e, d, inter, k = 384, 5120, 2304, 6
    w1, s1 = random_fp4((inter, d), 1, e)
    w3, s3 = random_fp4((inter, d), 1, e)
    w2, s2 = random_fp4((d, inter), 1, e)
    stacks = (w1[0], s1[0], w3[0], s3[0], w2[0], s2[0])
    roof = 6 * 3 * inter * d * (0.5 + 1 / 32) / HBM * 1e6
    print(f"== grouped MoE 384 experts top-6 (roofline at one token {roof:.1f} us)", flush=True)
    inputs = {}
    for t in (1, 32):
        tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        routes = [torch.rand(t, e, device="cuda").topk(k, dim=-1).indices for _ in range(4)]
        inputs[t] = (tokens, routes, torch.rand(t, k, device="cuda"))
    variants = [("f16 slices (old default)", False, None, None, None)]
    for bn, bk, w, st in [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4),
                          (64, 256, 4, 4)]:
        for chunk in ({"up": 1280, "down": 1152}, {"up": 640, "down": 768}, {"up": 2560, "down": 2304}):
            if chunk["up"] % bk or chunk["down"] % bk:
                continue
            variants.append((f"scaled BN{bn} BK{bk} w{w} s{st} up{chunk['up']} down{chunk['down']}", True,
                             dict(BN=bn, BM=16, BK=bk, num_warps=w, num_stages=st), chunk, False))
    for label, scaled, tile, chunk, f16 in variants:
        lin.SCALED_DOTS = scaled
        try:
            times = [graph_us([lambda r=r, x=x, wt=wt: grouped_moe(x, r, wt, *stacks, limit=10.0, tile=tile,
                                                                   k_chunks=chunk, f16_slices=f16) for r in routes])
                     for x, routes, wt in inputs.values()]
            print(f"  {label:<52} T=1 {times[0]:7.1f} us  T=32 {times[1]:8.1f} us", flush=True)
        except Exception as error:
            print(f"  {label}: failed {type(error).__name__}: {str(error)[:300]}", flush=True)
    lin.SCALED_DOTS = True


def head_tiles():
    n, k = 129280, 5120
    w = torch.randn(n, k, device="cuda")
    print(f"== fp32 head {n}x{k}: roofline {n * k * 4 / HBM * 1e6:.0f} us", flush=True)
    for m in (1, 32):
        x = torch.randn(m, k, device="cuda")
        for label, tile in (("BM16", lin.FP32_DECODE_TILE), ("BM32", lin.DECODE_TILE)):
            us = graph_us([lambda: lin.run_linear(x, None, w, None, 0, n, k, torch.float32, torch.float32,
                                                  tile=lin.launch_tile(tile, torch.float32))], reps=5)
            print(f"  M={m} {label}: {us:.0f} us", flush=True)
    del w


if __name__ == "__main__":
    t0 = time.time()
    from probe2 import model_linears
    for f in (linears_ab, moe_ab, head_tiles, model_linears):
        try:
            f()
        except Exception:
            import traceback
            traceback.print_exc()
        print(f"[{time.time() - t0:.0f} s]", flush=True)
