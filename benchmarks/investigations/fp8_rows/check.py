"""The Gluon rows kernel for FP8 linears (fp8_rows.py) against the package's Triton rows kernel (linear_rows.py).

    python benchmarks/investigations/fp8_rows/check.py sass [--triton DIR]   # offline sm_90: registers, loop mix
    python3 benchmarks/investigations/fp8_rows/check.py gpu                  # correctness and time, released shapes

`sass` compiles both for sm_90 without a GPU (`--triton`: another Triton first on the path, e.g. the GPU machine's
3.6) and prints, per slice of each main loop, the instructions per weight byte and the barriers. `gpu` checks the
Gluon kernel against the float64 product and for batch invariance (a row's bits at 1 to 8 rows; one raw row QDQ'd
inside equals the QDQ launch's), then times both at the decode step's FP8 shapes at 1, 6 and 8 rows as the model calls them (raw rows;
more than one QDQ'd by a launch first), replayed from CUDA graphs over enough weight copies to defeat L2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
ROWS = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
        "count_ptr": "*i32", "w2_ptr": "*fp8e4nv", "s2_ptr": "*u8", "out2_ptr": "*bf16"}


def sass() -> None:
    import triton.language as tl
    from fp8_rows import _fp8_rows_kernel
    from offline_sass import compile_sass, loops

    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE
    from modeling_deepseek_v41.kernels.triton.linear_rows import _linear_rows_kernel

    def show(name, listing, resources, weight_bytes_per_thread):
        main = max((loop for loop in loops(listing) if loop[1]["FFMA"]), key=lambda loop: loop[0])
        print(f"{name}: {resources.split('SHARED')[0].strip()}; loop {main[0]} instructions, "
              f"{main[0] / weight_bytes_per_thread:.1f} per weight byte, {main[1]['BAR']} barriers; "
              + ", ".join(f"{op} {count}" for op, count in main[1].most_common(6)))

    for rows in (1, 6, 8):
        listing, resources, _ = compile_sass(_linear_rows_kernel, ROWS, dict(
            BN=64, BK=256, BM=rows, WFMT=FMT_FP8_TILE, PAIR=False, ACC=tl.float32, W_ROUND=tl.float32,
            QDQ_X=rows == 1, PREFETCH=False), gluon=False)
        show(f"triton rows BN64 BK256, {rows} row(s)", listing, resources, 64 * 256 / 128)
        for bn in (32, 64):
            x = "bf16" if rows == 1 else "fp32"  # as gluon_rows_linear passes them
            listing, resources, _ = compile_sass(_fp8_rows_kernel, dict(ROWS, x_ptr=f"*{x}"), dict(
                BN=bn, BK=256, BM=rows, PAIR=False, QDQ_X=rows == 1, WARPS=4))
            show(f"gluon rows BN{bn} BK256, {rows} row(s) of {x}", listing, resources, bn * 256 / 128)


def gpu() -> None:
    import torch
    from fp8_rows import gluon_rows_linear
    from kernel_tuning import ROWS_SHAPES
    from triton_kernels import HBM, copies, graph_ms, random_fp8

    from modeling_deepseek_v41.kernels import numerics
    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE
    from modeling_deepseek_v41.kernels.triton.linear_rows import rows_linear

    if not torch.cuda.is_available():
        raise SystemExit("check.py gpu needs a CUDA GPU (check.py sass compiles without one).")
    print(torch.cuda.get_device_name())
    failures = 0
    for name, n, n2, k, groups in ROWS_SHAPES:
        nbytes = (groups * n + n2) * k
        count = copies(nbytes)
        w1, s1 = random_fp8(groups * n, k, count)
        w2, s2 = random_fp8(max(n2, 32), k, count)
        raw = (torch.randn(8, groups * k, device="cuda") * 3).to(torch.bfloat16)
        xq = numerics.fp8_act_qdq(raw.float().cpu()).cuda()
        exact = torch.block_diag(*numerics.dequantize_fp8_weight(w1[0].cpu(), s1[0].cpu()).double().view(
            groups, n, k).unbind()).cuda() if groups > 1 else numerics.dequantize_fp8_weight(
            w1[0].cpu(), s1[0].cpu()).double().cuda()
        second = (w2[0], s2[0], n2) if n2 else None

        def gluon(x, i=0, quantize=False):
            got = gluon_rows_linear(x, w1[i], s1[i], n, k, torch.float32, groups=groups, quantize=quantize,
                                    second=(w2[i], s2[i], n2) if n2 else None)
            return got[0] if n2 else got

        full = gluon(xq.to(torch.bfloat16))
        rel = ((full.double() - xq.double() @ exact.t()).norm() / (xq.double() @ exact.t()).norm()).item()
        same = all(torch.equal(gluon(xq[8 - m:].to(torch.bfloat16)), full[8 - m:]) for m in range(1, 8))
        inside = torch.equal(gluon(raw[:1], quantize=True), full[:1])
        ok = rel < 2e-6 and same and inside
        failures += not ok
        print(f"{name}: rel {rel:.1e}, batch invariant {same}, QDQ inside {inside}: {'ok' if ok else 'FAILED'}")
        if second is not None:
            pair = gluon_rows_linear(xq[:3].to(torch.bfloat16), w1[0], s1[0], n, k, torch.float32, second=second)[1]
            exact2 = numerics.dequantize_fp8_weight(w2[0].cpu(), s2[0].cpu()).double().cuda()
            rel2 = ((pair.double() - xq[:3].double() @ exact2.t()).norm() / (xq[:3].double() @ exact2.t()).norm())
            failures += not rel2 < 2e-6
            print(f"  the pair's second weight: rel {rel2.item():.1e}")
        times = {}
        for m in (1, 6, 8):
            x = raw[:m]  # as the model's linears pass them: raw, QDQ'd inside at one row, by a launch first above

            def args(i):
                return dict(second=(w2[i], s2[i], n2) if n2 else None, groups=groups, quantize=True)
            times[("triton", m)] = graph_ms([lambda i=i: rows_linear(x, w1[i], s1[i], FMT_FP8_TILE, n, k,
                                                                     torch.bfloat16, **args(i))
                                             for i in range(count)])
            times[("gluon", m)] = graph_ms([lambda i=i: gluon_rows_linear(x, w1[i], s1[i], n, k, torch.bfloat16,
                                                                          **args(i))
                                            for i in range(count)])
        print(f"  roofline {nbytes / HBM * 1e6:.1f} us; " + "  ".join(
            f"M={m}: triton {times[('triton', m)] * 1e3:.1f} / gluon {times[('gluon', m)] * 1e3:.1f} us"
            for m in (1, 6, 8)))
    print("all correct" if not failures else f"{failures} FAILED")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("sass", "gpu"))
    parser.add_argument("--triton", type=Path, help="a directory holding another Triton, put first on the path")
    args = parser.parse_args()
    sys.path[:0] = ([str(args.triton)] if args.triton else []) + [str(HERE), str(ROOT / "benchmarks"), str(ROOT)]
    sass() if args.mode == "sass" else gpu()


if __name__ == "__main__":
    main()
