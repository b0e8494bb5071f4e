"""Times the Triton kernels at the released widths against the HBM roofline, the FP8 tensor-core peak, torch's
bf16 matmul and the fp32 emulation (one H200; CUDA graphs, rotating weight copies so the L2 cannot hold them).

    python benchmarks/triton_kernels.py [--out DIR] [--only moe moe_prefill ...]  # writes DIR/kernels.txt
                                                                                  # (default: $OUT or .)
"""

from __future__ import annotations

import argparse
import math
import os
import traceback

import torch
import torch.nn.functional as F

from modeling_deepseek_v41.kernels.expert_ops import gathered_swiglu
from modeling_deepseek_v41.kernels.triton import (dense_linear, fp4_linear, fp4_to_fp8_weight, fp8_linear,
                                                  fp8_row_linear, grouped_moe)
from modeling_deepseek_v41.kernels.triton.linear_rows import ROWS_MAX_ROWS
from modeling_deepseek_v41.kernels.triton.mma_choice import gluon_available, use_mma_linears
from modeling_deepseek_v41.layers.linear import DeepseekV41Linear
from realwidth import timed_ms

HBM = 4.8e12  # bytes/s, H200 datasheet
FP8_PEAK = 1979e12  # dense FP8 FLOP/s, H100/H200 SXM datasheet
L2_FLUSH_BYTES = 240e6  # rotate among enough weight copies to be 4x the 60 MB L2
ROWS = [1, 16, 32, 64, 256, 4096]
LINEARS = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
           ("shared_w1", 2304, 5120), ("shared_w2", 5120, 2304)]
lines: list[str] = []


def log(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def graph_ms(calls) -> float:
    """Median ms per call of `calls` (a list of closures) replayed from one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / len(calls)


def copies(nbytes: float) -> int:
    return max(1, min(16, math.ceil(L2_FLUSH_BYTES / nbytes)))


def random_fp8(n, k, count):
    w = [(torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(count)]
    s = [torch.randint(115, 121, (-(-n // 32), -(-k // 32)), device="cuda").to(torch.uint8).view(
        torch.float8_e8m0fnu) for _ in range(count)]
    return w, s


def random_fp4(shape_nk, count, experts=None):
    n, k = shape_nk
    lead = () if experts is None else (experts,)
    w = [torch.randint(-128, 128, (*lead, n, k // 2), device="cuda", dtype=torch.int8) for _ in range(count)]
    s = [torch.randint(118, 124, (*lead, n, k // 32), device="cuda").to(torch.uint8).view(torch.float8_e8m0fnu)
         for _ in range(count)]
    return w, s


def row(name, m, ms, nbytes, flops, extra=""):
    roof = nbytes / HBM * 1e3
    peak = flops / FP8_PEAK * 1e3
    log(f"{name:<26} {m:>5} {ms * 1e3:>9.1f} {nbytes / ms / 1e6:>8.0f} {roof * 1e3:>8.1f} "
        f"{max(roof, peak) / ms * 100:>6.0f}% {flops / ms / 1e9:>8.1f}  {extra}")


def header(title, columns=True):
    log()
    log(title)
    if columns:
        log(f"{'kernel':<26} {'rows':>5} {'us':>9} {'GB/s':>8} {'roof us':>8} {'floor%':>7} {'TFLOP/s':>8}  vs")


def bench_linears():
    header("FP8 block-scaled linears (x bf16; floor = max(bytes/4.8TB/s, flops/FP8 peak); 'bf16' = torch "
           "F.linear with a bf16 weight of the same shape, 'emul' = DeepseekV41Linear's fp32 emulation)")
    for name, n, k in LINEARS:
        count = copies(n * k)
        ws, ss = random_fp8(n, k, count)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies(2 * n * k))]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = graph_ms([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in zip(ws, ss)])
            ms_bf16 = graph_ms([lambda w=w: F.linear(x, w) for w in wb])
            ms_dense = graph_ms([lambda w=w: dense_linear(x, w) for w in wb])
            extra = f"bf16 {ms_bf16 * 1e3:.1f} us, our bf16 dense_linear {ms_dense * 1e3:.1f} us"
            if m <= 256:
                ms_f = graph_ms([lambda w=w, s=s: fp8_linear(x, w, s, fp8_dot=True) for w, s in zip(ws, ss)])
                extra += f", fp8-dot {ms_f * 1e3:.1f} us"
            if m <= ROWS_MAX_ROWS and gluon_available():  # the tensor-core rows (fp8_mma.py)
                use_mma_linears(True)
                ms_t = graph_ms([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in zip(ws, ss)])
                use_mma_linears(False)
                extra += f", mma {ms_t * 1e3:.1f} us"
            if m == 4096:
                ms_b = graph_ms([lambda w=w, s=s: fp8_linear(x, w, s, fp8_dot=False) for w, s in zip(ws, ss)])
                extra += f", Triton exact bf16-dot {ms_b * 1e3:.1f} us"
                ms_f = graph_ms([lambda w=w, s=s: fp8_linear(x, w, s, fp8_dot=True) for w, s in zip(ws, ss)])
                extra += f", Triton fp8-dot {ms_f * 1e3:.1f} us"
            if m in (1, 256):
                layer = DeepseekV41Linear(k, n, storage="fp8").cuda()
                layer.weight.data, layer.scale.data = ws[0], ss[0]
                extra += f", emul {graph_ms([lambda: layer(x)]) * 1e3:.0f} us"
            nbytes = n * k + ss[0].numel() + 2 * m * (n + k)
            row(f"fp8_linear {name} {n}x{k}", m, ms, nbytes, 2 * m * n * k, extra)
        del ws, ss, wb


def bench_fp4_linears():
    header("FP4 expert linears (packed e2m1, E8M0 per 32; 'fp8re' = the exact FP8 re-encode, 2x the bytes)")
    for name, n, k in [("expert_w1", 2304, 5120), ("expert_w2", 5120, 2304)]:
        count = copies(n * k / 2)
        ws, ss = random_fp4((n, k), count)
        w8 = [fp4_to_fp8_weight(w) for w in ws[:copies(n * k)]]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = graph_ms([lambda w=w, s=s: fp4_linear(x, w, s) for w, s in zip(ws, ss)])
            ms8 = graph_ms([lambda w=w, s=s: fp8_row_linear(x, w, s) for w, s in zip(w8, ss)])
            ms4f = graph_ms([lambda w=w, s=s: fp4_linear(x, w, s, fp8_dot=True) for w, s in zip(ws, ss)])
            nbytes = n * k / 2 + n * k / 32 + 2 * m * (n + k)
            row(f"fp4_linear {name} {n}x{k}", m, ms, nbytes, 2 * m * n * k,
                f"fp8re {ms8 * 1e3:.1f} us, W4A8 fp8-dot {ms4f * 1e3:.1f} us")
        del ws, ss, w8


def bench_moe():
    header("Grouped MoE, 384 experts, top-6, hidden 5120, intermediate 2304 (bytes = experts touched x 3 "
           "projections; 4 routings rotated per graph; 'emul' = the model's gathered_swiglu path)")
    e, d, inter, k = 384, 5120, 2304, 6
    w1, s1 = random_fp4((inter, d), 1, e)
    w3, s3 = random_fp4((inter, d), 1, e)
    w2, s2 = random_fp4((d, inter), 1, e)
    fp4 = (w1[0], s1[0], w3[0], s3[0], w2[0], s2[0])
    fp8 = (fp4_to_fp8_weight(w1[0]), s1[0], fp4_to_fp8_weight(w3[0]), s3[0], fp4_to_fp8_weight(w2[0]), s2[0])
    dense = tuple(None if shape is None else torch.randn(e, *shape, device="cuda", dtype=torch.bfloat16) * 0.02
                  for shape in [(inter, d), None, (inter, d), None, (d, inter), None])
    for t in ROWS:
        tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        routes = [torch.rand(t, e, device="cuda").topk(k, dim=-1).indices for _ in range(4)]
        weights = torch.rand(t, k, device="cuda")
        touched = sum(r.unique().numel() for r in routes) / len(routes)
        results = {}
        modes = [("fp4", fp4, 3 * inter * d * (0.5 + 1 / 32)), ("fp8re", fp8, 3 * inter * d * (1 + 1 / 32)),
                 ("bf16", dense, 3 * inter * d * 2)]
        if t in (1, 64):
            modes.append(("fp4 fp8-dot", fp4, 3 * inter * d * (0.5 + 1 / 32)))
        if gluon_available():  # the tensor-core decode (moe_mma.py)
            modes.append(("fp4 mma", fp4, 3 * inter * d * (0.5 + 1 / 32)))
        for mode, stacks, per_expert in modes:
            # the grouped GEMM reads counts back: no graph
            formulation = {"mma": True} if mode == "fp4 mma" else {"grouped_gemm": False}
            calls = [lambda r=r, st=stacks, mode=mode, f=formulation: grouped_moe(
                tokens, r, weights, *st, limit=10.0, fp8_experts=mode == "fp8re", fp8_dot="fp8-dot" in mode, **f)
                for r in routes]
            results[mode] = (graph_ms(calls), touched * per_expert)
        extra = ", ".join(f"{m} {ms * 1e3:.1f} us ({b / HBM * 1e6:.1f} roof)" for m, (ms, b) in results.items()
                          if m != "fp4")
        if t <= 16:
            for mode, stacks in (("emul fp4", fp4), ("emul bf16", dense)):
                order = routes[0].argsort(dim=-1)
                ms = graph_ms([lambda st=stacks: gathered_swiglu(tokens, routes[0].gather(1, order),
                                                                 weights.gather(1, order), 10.0, *st)])
                extra += f", {mode} {ms * 1e3:.0f} us"
        ms, nbytes = results["fp4"]
        row("grouped_moe fp4", t, ms, nbytes + 2 * t * d * 2, 2 * t * k * 3 * inter * d, extra)


def bench_moe_prefill():
    header("Grouped MoE prefill, 384 experts, top-6, FP4 (effective TFLOP/s: 2 x tokens x 6 x 3 x 2304 x 5120 "
           "over the time): torch's grouped GEMM over bf16 copies of the experts, the FP4 tiles", columns=False)
    e, d, inter, k = 384, 5120, 2304, 6
    stacks = []
    for shape in ((inter, d), (inter, d), (d, inter)):
        w, sc = random_fp4(shape, 1, e)
        stacks += [w[0], sc[0]]
    from modeling_deepseek_v41.kernels.triton.moe_grouped_gemm import fp4_to_bf16
    for w, sc in zip(stacks[::2], stacks[1::2]):
        ms = timed_ms(lambda: fp4_to_bf16(w, sc), repeats=3, warmup=1)
        moved = w.numel() + sc.numel() + 2 * w.numel() * 2  # FP4 and scales read, bf16 written
        log(f"  fp4_to_bf16 {tuple(w.shape)}: {ms:.2f} ms, {moved / ms / 1e9:.2f} TB/s")
    for t in (2048, 4096, 16384):
        tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        route = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
        weights = torch.rand(t, k, device="cuda")
        flops = 2 * t * k * 3 * inter * d
        for name, flag in (("grouped GEMM", True), ("FP4 tiles", False)):
            torch.cuda.reset_peak_memory_stats()
            ms = timed_ms(lambda: grouped_moe(tokens, route, weights, *stacks, limit=10.0, grouped_gemm=flag),
                          repeats=3, warmup=1)  # events, no graph: the grouped GEMM reads counts back
            log(f"  T={t:>6} {name:<13} {ms:9.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  "
                f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def check_moe_fp8_dot():
    """Relative difference of grouped_moe's FP8-dot mode from its exact mode, by block height and case."""
    from modeling_deepseek_v41.kernels.triton import moe as moe_kernels
    header_line = "grouped_moe fp8_dot vs exact (rel. difference), small shapes, by decode block rows BM"
    log()
    log(header_line)
    e, d, inter = 6, 64, 64
    stacks = []
    for n, k in ((inter, d), (inter, d), (d, inter)):
        w, s = random_fp4((n, k), 1, e)
        stacks += [w[0], s[0]]
    default = dict(moe_kernels.MOE_DECODE_TILE)
    for bm in (16, 32):
        moe_kernels.MOE_DECODE_TILE.update(BM=bm)
        for t, k in ((1, 1), (4, 1), (9, 3)):
            tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
            experts = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
            weights = torch.rand(t, k, device="cuda")
            exact = grouped_moe(tokens, experts, weights, *stacks, limit=10.0)
            fast = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, fp8_dot=True)
            rel = ((fast - exact).norm() / exact.norm()).item()
            log(f"  BM {bm:>2} tokens {t} top-{k}: {rel:.2e}")
    moe_kernels.MOE_DECODE_TILE.update(default)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    benches = {"moe_fp8_dot": check_moe_fp8_dot, "linears": bench_linears, "fp4_linears": bench_fp4_linears,
               "moe": bench_moe, "moe_prefill": bench_moe_prefill}
    parser.add_argument("--only", nargs="+", choices=sorted(benches), default=sorted(benches))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    for bench in (benches[name] for name in args.only):
        try:
            bench()
        except Exception:  # keep the other tables when one fails
            log(traceback.format_exc())
        with open(os.path.join(args.out, "kernels.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
