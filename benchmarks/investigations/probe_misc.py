"""Probe (not committed): mHC split width and MoE decode tilings at the released widths, CUDA-graph timed."""
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_linear import graph_us  # noqa: E402
from triton_kernels import random_fp4  # noqa: E402

from modeling_deepseek_v41.kernels.triton import grouped_moe  # noqa: E402
from modeling_deepseek_v41.kernels.triton import mhc as mhc_kernels  # noqa: E402


def sweep_mhc():
    d, hc = 5120, 4
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda"), torch.rand(24, device="cuda")
    norm = torch.rand(d, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 32):
        streams = [torch.randn(rows, hc, d, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        out = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(rows, hc, device="cuda")
        comb = torch.rand(rows, hc, hc, device="cuda")
        for bd in (32, 64, 128, 256):
            mhc_kernels.BLOCK_D = bd
            us = graph_us([lambda s=s: mhc_kernels.hc_step(s, w, fn, scale, base, norm, 20, 1e-6, 1e-6, 1e-6, out, w,
                                                            comb) for s in streams])
            print(f"  hc_step expand rows {rows} BD {bd}: {us:.1f} us", flush=True)
    mhc_kernels.BLOCK_D = 128


def sweep_moe():
    e, d, inter, k = 384, 5120, 2304, 6
    w1, s1 = random_fp4((inter, d), 1, e)
    w3, s3 = random_fp4((inter, d), 1, e)
    w2, s2 = random_fp4((d, inter), 1, e)
    stacks = (w1[0], s1[0], w3[0], s3[0], w2[0], s2[0])
    tiles = [dict(BN=bn, BM=16, BK=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
             [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 8, 3), (32, 256, 4, 3), (64, 128, 4, 5),
              (32, 128, 4, 4)]]
    chunks = [dict(up=u, down=dn) for u, dn in [(5120, 2304), (1280, 1152), (640, 384), (2560, 768)]]
    inputs = {}
    for t in (1, 32):
        tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        routes = [torch.rand(t, e, device="cuda").topk(k, dim=-1).indices for _ in range(4)]
        inputs[t] = (tokens, routes, torch.rand(t, k, device="cuda"))
    roof = 6 * 3 * inter * d * (0.5 + 1 / 32) / 4.8e12 * 1e6
    print(f"grouped_moe roofline at 1 token {roof:.1f} us", flush=True)
    for f16, tile, chunk in itertools.product((True,), tiles, chunks):
        if chunk["up"] % tile["BK"] or chunk["down"] % tile["BK"]:
            continue
        try:
            times = [graph_us([lambda r=r, x=x, wt=wt: grouped_moe(x, r, wt, *stacks, limit=10.0, tile=tile,
                                                                   k_chunks=chunk, f16_slices=f16) for r in routes])
                     for x, routes, wt in inputs.values()]
        except Exception as error:
            print(f"  moe {tile} {chunk}: failed ({type(error).__name__}: {error})"[:300], flush=True)
            continue
        print(f"  moe BN{tile['BN']} BK{tile['BK']} w{tile['num_warps']} s{tile['num_stages']} up {chunk['up']} "
              f"down {chunk['down']}: T=1 {times[0]:.1f} us  T=32 {times[1]:.1f} us", flush=True)


if __name__ == "__main__":
    t0 = time.time()
    sweep_mhc()
    print(f"mhc {time.time() - t0:.0f} s", flush=True)
    sweep_moe()
    print(f"total {time.time() - t0:.0f} s", flush=True)
