"""Probe (not committed): candidate decode linear formulations at the released shapes, CUDA-graph timed."""
import itertools
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from modeling_deepseek_v41.kernels.triton.common import arrive_last, sum_partials  # noqa: E402
from modeling_deepseek_v41.kernels.triton.linear import run_linear  # noqa: E402
from modeling_deepseek_v41.kernels.triton.quant import fp8_act_qdq, fp8_act_quant  # noqa: E402
from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE  # noqa: E402
from modeling_deepseek_v41.kernels.triton.workspace import arrival_counts  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HBM = 4.8e12


@triton.jit
def _bw_kernel(w_ptr, out_ptr, k_chunk, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.full([BN, BK], 0, tl.int32)
    k0 = pid_s * k_chunk
    for k in range(k0, k0 + k_chunk, BK):
        acc += tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + offs_k)[None, :]).to(tl.int32)
    tl.store(out_ptr + pid_s * 0 + offs_n, tl.sum(acc, 1))


@triton.jit
def _slice_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, k_chunk, splits,
                  stride_xm, stride_xsm, stride_wn, stride_sn, stride_om,
                  BN: tl.constexpr, BM: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr = False):
    """MODE 0: W8A8 (e4m3 x e4m3 dots per 32 slice, scales on the slice result). MODE 1: exact bf16 (e4m3 weight
    -> bf16 unscaled, x = QDQ'd bf16 values, weight scale on the slice result)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    c = tl.arange(0, 32)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + c[None, :]
    x_ptrs = x_ptr + rows[None, :] * stride_xm + c[:, None]
    s_ptrs = s_ptr + (offs_n // 32) * stride_sn
    acc = tl.full([BN, BM], 0.0, tl.float32)
    k0 = pid_s * k_chunk
    for k in range(k0, k0 + k_chunk, 32):
        w = tl.load(w_ptrs + k)
        x = tl.load(x_ptrs + k)
        sb = tl.load(s_ptrs + k // 32).to(tl.int32)
        ws = (sb << 23).to(tl.float32, bitcast=True)
        if IEEE:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if MODE == 0:
            xs = tl.load(xs_ptr + rows * stride_xsm + k // 32)
            acc += tl.dot(w, x) * (ws[:, None] * xs[None, :])
        elif IEEE:
            acc += tl.dot(w, x) * ws[:, None]
        else:
            acc += tl.dot(w.to(tl.bfloat16), x) * ws[:, None]
    offs = rows[None, :] * stride_om + offs_n[:, None]
    mask = rows[None, :] < M
    if splits == 1:
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)
    else:
        split_stride = M * stride_om
        tl.store(part_ptr + pid_s * split_stride + offs, acc, mask=mask)
        tile = pid_n * tl.num_programs(2) + pid_m
        if arrive_last(count_ptr, tile, splits):
            total = sum_partials(part_ptr, offs, mask, splits, split_stride)
            tl.store(out_ptr + offs, total.to(tl.bfloat16), mask=mask)


@triton.jit
def _prescaled_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, k_chunk, splits,
                      stride_xm, stride_wn, stride_sn, stride_om, BM: tl.constexpr, BK: tl.constexpr,
                      IEEE: tl.constexpr = False):
    """Exact bf16, 32 weight rows per program (one scale row): x' = x_qdq * weight scale (exact), one dot per BK."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * 32 + tl.arange(0, 32)
    rows = pid_m * BM + tl.arange(0, BM)
    c = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + c[None, :]
    x_ptrs = x_ptr + rows[None, :] * stride_xm + c[:, None]
    g = tl.arange(0, BK // 32)
    acc = tl.full([32, BM], 0.0, tl.float32)
    k0 = pid_s * k_chunk
    for k in range(k0, k0 + k_chunk, BK):
        w = tl.load(w_ptrs + k).to(tl.bfloat16)
        x = tl.load(x_ptrs + k).to(tl.float32)
        sb = tl.load(s_ptr + pid_n * stride_sn + k // 32 + g).to(tl.int32)
        ws = (sb << 23).to(tl.float32, bitcast=True)
        x = tl.reshape(tl.reshape(x, [BK // 32, 32, BM]) * ws[:, None, None], [BK, BM])
        if IEEE:
            acc = tl.dot(w.to(tl.float32), x, acc)
        else:
            acc = tl.dot(w, x.to(tl.bfloat16), acc)
    offs = rows[None, :] * stride_om + offs_n[:, None]
    mask = rows[None, :] < M
    if splits == 1:
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)
    else:
        split_stride = M * stride_om
        tl.store(part_ptr + pid_s * split_stride + offs, acc, mask=mask)
        tile = pid_n * tl.num_programs(2) + pid_m
        if arrive_last(count_ptr, tile, splits):
            total = sum_partials(part_ptr, offs, mask, splits, split_stride)
            tl.store(out_ptr + offs, total.to(tl.bfloat16), mask=mask)


def choose_splits(n_tiles, k, step, target):
    """splits dividing K/step, near target/n_tiles."""
    assert k % step == 0, (k, step)
    blocks = k // step
    want = max(1, min(blocks, math.ceil(target / n_tiles)))
    while blocks % want:
        want -= 1
    return want


def padded(x2d, bm):
    m = x2d.shape[0]
    mp = triton.cdiv(m, bm) * bm
    if mp == m:
        return x2d
    out = torch.zeros(mp, x2d.shape[1], dtype=x2d.dtype, device=x2d.device)
    out[:m] = x2d
    return out


def slice_linear(xq, xs, w, s, m, mode, bn, bm, target, stages, warps):
    n, k = w.shape
    splits = choose_splits(n // bn, k, 32, target)
    k_chunk = k // splits
    out = torch.empty(m, n, dtype=torch.bfloat16, device=w.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=w.device) if splits > 1 else out
    count = arrival_counts(w.device, (n // bn) * triton.cdiv(m, bm))
    grid = (n // bn, splits, triton.cdiv(m, bm))
    _slice_kernel[grid](xq, xs, w, s.view(torch.uint8), out, part, count, m, n, k_chunk, splits,
                        xq.stride(0), xs.stride(0), w.stride(0), s.stride(0), out.stride(0),
                        BN=bn, BM=bm, MODE=mode, IEEE=INTERP, num_warps=warps, num_stages=stages)
    return out


def prescaled_linear(xq, w, s, m, bm, bk, target, stages, warps):
    n, k = w.shape
    splits = choose_splits(n // 32, k, bk, target)
    k_chunk = k // splits
    out = torch.empty(m, n, dtype=torch.bfloat16, device=w.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=w.device) if splits > 1 else out
    count = arrival_counts(w.device, (n // 32) * triton.cdiv(m, bm))
    grid = (n // 32, splits, triton.cdiv(m, bm))
    _prescaled_kernel[grid](xq, w, s.view(torch.uint8), out, part, count, m, n, k_chunk, splits,
                            xq.stride(0), w.stride(0), s.stride(0), out.stride(0),
                            BM=bm, BK=bk, IEEE=INTERP, num_warps=warps, num_stages=stages)
    return out


def bw_read(w, bn, bk, target, stages, warps):
    n, k = w.shape
    splits = choose_splits(n // bn, k, bk, target)
    out = torch.empty(n, dtype=torch.int32, device=w.device)
    _bw_kernel[(n // bn, splits)](w.view(torch.uint8), out, k // splits, w.stride(0), BN=bn, BK=bk,
                                  num_warps=warps, num_stages=stages)
    return out


def graph_us(calls, reps=15):
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2] / len(calls) * 1e3


def rand_fp8(n, k, dev):
    w = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(115, 121, (n // 32, k // 32), device=dev).to(torch.uint8).view(torch.float8_e8m0fnu)
    return w, s


def emulate(x, w, s):
    n, k = w.shape
    wd = w.float() * s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    return fp8_act_qdq(x, torch.float32) @ wd.t()


def check(dev):
    """Interpreter/GPU correctness of the candidates against the emulation."""
    torch.manual_seed(0)
    n, k, m = 128, 256, 3
    w, s = rand_fp8(n, k, dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = emulate(x, w, s)
    q, xs = fp8_act_quant(x)
    qdq = fp8_act_qdq(x, torch.bfloat16)
    outs = {
        "w8a8": slice_linear(padded(q, 16), padded(xs, 16), w, s, m, 0, 64, 16, 4, 2, 4),
        "bf16slice": slice_linear(padded(qdq, 16), padded(xs, 16), w, s, m, 1, 64, 16, 4, 2, 4),
        "prescaled": prescaled_linear(padded(qdq, 16), w, s, m, 16, 128, 4, 2, 4),
    }
    for name, o in outs.items():
        err = ((o.float() - ref).norm() / ref.norm()).item()
        print(f"check {name}: rel {err:.2e}", flush=True)


SHAPES = [("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("wq_a+wkv", 1792, 5120), ("shared_w13", 4608, 5120),
          ("wq_a", 1280, 5120), ("shared_w2", 5120, 2304)]


def sweep():
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, n, k in SHAPES:
        copies = max(2, min(12, math.ceil(240e6 / (n * k))))
        ws = [rand_fp8(n, k, dev) for _ in range(copies)]
        roof = (n * k + n * k / 1024) / HBM * 1e6
        print(f"\n== {name} {n}x{k}: roofline {roof:.1f} us, {copies} copies", flush=True)
        results = []
        for bn, bk, target, stages, warps in [(64, 128, 264, 3, 4), (128, 256, 264, 3, 4), (64, 256, 528, 4, 4),
                                              (128, 128, 528, 4, 4), (32, 256, 264, 3, 4)]:
            try:
                us = graph_us([lambda w=w: bw_read(w, bn, bk, target, stages, warps) for w, _ in ws])
                results.append((us, f"bw BN{bn} BK{bk} t{target} s{stages} w{warps}"))
            except Exception as e:
                print("bw fail", bn, bk, type(e).__name__, str(e)[:200], flush=True)
        for us, label in sorted(results)[:3]:
            print(f"  {label:<44} {us:7.1f} us  {roof / us * 100:4.0f}% of roof", flush=True)
        for m in (1, 32):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, xs = fp8_act_quant(x)
            qdq = fp8_act_qdq(x, torch.bfloat16)
            results = []
            t0 = time.time()
            results.append((graph_us([lambda w=w, s=s: run_linear(qdq, None, w, s, FMT_FP8_TILE, n, k, torch.bfloat16,
                                                                  torch.bfloat16) for w, s in ws]), "current exact"))
            results.append((graph_us([lambda w=w, s=s: run_linear(q, xs, w, s, FMT_FP8_TILE, n, k, torch.bfloat16,
                                                                  torch.float8_e4m3fn) for w, s in ws]), "current fp8dot"))
            for bm in sorted({16, 32 if m > 16 else 16}):
                qp, xsp, qdqp = padded(q, bm), padded(xs, bm), padded(qdq, bm)
                for mode, bn, target, stages, warps in itertools.product((0, 1), (64, 128), (132, 264, 528), (4, 6),
                                                                         (4,)):
                    try:
                        us = graph_us([lambda w=w, s=s: slice_linear(qp if mode == 0 else qdqp, xsp, w, s, m, mode, bn,
                                                                     bm, target, stages, warps) for w, s in ws])
                        results.append((us, f"{'w8a8' if mode == 0 else 'bf16slice'} BN{bn} BM{bm} t{target} "
                                            f"s{stages} w{warps}"))
                    except Exception as e:
                        print("slice fail", mode, bn, bm, stages, type(e).__name__, str(e)[:200], flush=True)
                for bk, target, stages, warps in itertools.product((128, 256), (264, 528, 1056), (3, 5), (4,)):
                    try:
                        us = graph_us([lambda w=w, s=s: prescaled_linear(qdqp, w, s, m, bm, bk, target, stages, warps)
                                       for w, s in ws])
                        results.append((us, f"prescaled BN32 BM{bm} BK{bk} t{target} s{stages} w{warps}"))
                    except Exception as e:
                        print("prescaled fail", bk, type(e).__name__, str(e)[:200], flush=True)
            results.sort()
            print(f" M={m} ({time.time() - t0:.0f} s)", flush=True)
            shown = results[:6] + [r for r in results if r[1].startswith("current")]
            best = {}
            for us, label in results:
                best.setdefault(label.split()[0], (us, label))
            for us, label in shown + [v for k_, v in best.items() if v not in shown]:
                print(f"  {label:<44} {us:7.1f} us  {roof / us * 100:4.0f}% of roof", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if INTERP or not torch.cuda.is_available():
        check("cpu")
    else:
        check("cuda")
        sweep()
