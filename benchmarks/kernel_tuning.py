"""Sweeps the decode tilings of the Triton linears and the grouped MoE at the released shapes (one H200) and
prints, per shape, each tiling's time at 1 and 32 rows (linears) or 1, 6 and 32 tokens (MoE), fastest first.

The decode tiling must be a function of the weight's shape alone (batch invariance), so a tiling is judged on
every row count at once; the chosen ones are written into kernels/triton/linear.py and moe.py by hand.

    python benchmarks/kernel_tuning.py [--out DIR] [--only moe|linears|rows]   # writes DIR/tuning.txt (default: $OUT or .)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from modeling_deepseek_v41.kernels.triton import fp8_act_qdq, grouped_moe  # noqa: E402
from modeling_deepseek_v41.kernels.triton.common import FMT_FP4_ROW, FMT_FP8_TILE  # noqa: E402
from modeling_deepseek_v41.kernels.triton.linear import run_linear  # noqa: E402
from modeling_deepseek_v41.kernels.triton.linear_rows import rows_linear  # noqa: E402
from triton_kernels import HBM, LINEARS as ATTENTION_AND_SHARED, copies, graph_ms, random_fp4, random_fp8  # noqa: E402

LINEARS = [(name, n, k, "fp8") for name, n, k in ATTENTION_AND_SHARED] + [("expert_w1", 2304, 5120, "fp4")]
TILES = [dict(BN=bn, BM=bm, BK=bk, num_warps=w, num_stages=st) for bn, bm, bk, w, st in
         [(64, 32, 128, 4, 3), (64, 32, 256, 4, 3), (128, 32, 128, 8, 3), (128, 32, 256, 8, 3), (64, 32, 128, 4, 4),
          (64, 16, 256, 4, 3), (32, 32, 256, 4, 3), (64, 32, 512, 8, 2), (64, 16, 128, 4, 4)]]
SPLIT_TARGETS = [66, 132, 264, 528]
lines: list[str] = []


def log(text: str = "") -> None:
    print(text, flush=True)
    lines.append(text)


def tile_name(tile: dict) -> str:
    return f"BN{tile['BN']} BM{tile['BM']} BK{tile['BK']} w{tile['num_warps']} s{tile['num_stages']}"


def sweep_linears() -> None:
    for name, n, k, storage in LINEARS:
        nbytes = n * k * (0.5 if storage == "fp4" else 1.0)
        if storage == "fp4":
            ws, ss = random_fp4((n, k), copies(nbytes))
            fmt = FMT_FP4_ROW
        else:
            ws, ss = random_fp8(n, k, copies(nbytes))
            fmt = FMT_FP8_TILE
        xs = {m: fp8_act_qdq(torch.randn(m, k, device="cuda", dtype=torch.bfloat16)) for m in (1, 32)}
        results = []
        for tile, target in itertools.product(TILES, SPLIT_TARGETS):
            try:
                times = [graph_ms([lambda w=w, s=s, q=xs[m]: run_linear(q, None, w, s, fmt, n, k, torch.bfloat16,
                                                                        torch.bfloat16, tile=tile, split_target=target)
                                   for w, s in zip(ws, ss)]) for m in (1, 32)]
            except Exception as error:  # a tiling the compiler refuses (shared memory): say so, go on
                log(f"  {name} {tile_name(tile)} t{target}: failed ({type(error).__name__})")
                continue
            results.append((times[0] + times[1], times, tile, target))
        results.sort(key=lambda r: r[0])
        log(f"\n{name} {n}x{k} {storage}: roofline {nbytes / HBM * 1e6:.1f} us")
        for _, (t1, t32), tile, target in results[:8]:
            log(f"  {tile_name(tile):<28} target {target:>5}: M=1 {t1 * 1e3:6.1f} us  M=32 {t32 * 1e3:6.1f} us")
        del ws, ss


def sweep_moe() -> None:
    """The exact FP4 formulations over tilings and decode K splits: the rows formulation (moe_rows) and the
    tensor-core experts (moe_mma, over K splits) against the committed tensor-core tiles (f16 slices); at 384
    experts (1, 6, 32 tokens) and at 32 (32 tokens: the realwidth benchmark's cut, where each expert sees ~6 rows)."""
    e, d, inter, k = 384, 5120, 2304, 6
    w1, s1 = random_fp4((inter, d), 1, e)
    w3, s3 = random_fp4((inter, d), 1, e)
    w2, s2 = random_fp4((d, inter), 1, e)
    stacks = (w1[0], s1[0], w3[0], s3[0], w2[0], s2[0])
    cases = {}
    for t, experts in ((1, e), (6, e), (32, e), (32, 32)):
        tokens = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        routes = [torch.rand(t, experts, device="cuda").topk(k, dim=-1).indices for _ in range(4)]
        cases[f"T={t} E={experts}"] = (tokens, routes, torch.rand(t, k, device="cuda"))
    rows_tiles = [dict(BN=bn, BM=16, BK=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
                  [(64, 128, 4, 1), (64, 128, 4, 2), (32, 128, 4, 1), (32, 128, 4, 2)]]
    # the next slice's loads issued ahead into registers (no shared memory): loads in flight while a warp computes
    rows_tiles += [dict(BN=bn, BM=16, BK=bk, num_warps=w, num_stages=1, prefetch=True) for bn, bk, w in
                   [(64, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (128, 128, 8)]]
    chunks = [dict(up=u, down=dn) for u, dn in [(1280, 1152), (640, 576)]]
    variants = [("rows", tile, chunk) for tile, chunk in itertools.product(rows_tiles, chunks)]
    variants += [("f16", None, None), ("bf16", None, None)]
    # the tensor-core experts over K splits: how many programs a launch has against the SMs' room for them (wave
    # quantization at one token) moves with the split
    variants += [("mma", None, dict(up=u, down=dn)) for u, dn in [(1280, 1152), (640, 576), (2560, 2304), (512, 384)]]
    variants += [("mma", dict(prefetch=False), dict(up=u, down=dn)) for u, dn in [(1280, 1152), (2560, 2304)]]
    results = []
    for form, tile, chunk in variants:
        options = dict(rows=True) if form == "rows" else dict(mma=True) if form == "mma" else \
            dict(f16_slices=form == "f16")
        try:
            times = [graph_ms([lambda r=r, x=x, wt=wt: grouped_moe(x, r, wt, *stacks, limit=10.0, tile=tile,
                                                                     k_chunks=chunk, **options) for r in routes])
                     for x, routes, wt in cases.values()]
        except Exception as error:
            log(f"  moe {form} {tile} {chunk}: failed ({type(error).__name__}: {error})"[:300])
            continue
        results.append((sum(times[:3]), times, form, tile, chunk))
        print(f"  moe {form} {tile} {chunk}: " + "  ".join(f"{ms * 1e3:.1f}" for ms in times),
              flush=True)  # as it goes: a sweep stopped at its time limit still tells something
    results.sort(key=lambda r: r[0])
    roof = 6 * 3 * inter * d * (0.5 + 1 / 32) / HBM * 1e6
    log(f"\ngrouped_moe fp4, top-6: roofline at 1 token {roof:.1f} us, at 32 tokens over 32 experts "
        f"{32 * 3 * inter * d * (0.5 + 1 / 32) / HBM * 1e6:.1f} us")
    for _, times, form, tile, chunk in results:
        shown = "  ".join(f"{name} {ms * 1e3:7.1f} us" for name, ms in zip(cases, times))
        ahead = {None: "", True: " prefetch", False: " no prefetch"}[tile.get("prefetch") if tile else None]
        where = (f"BN{tile['BN']} BK{tile['BK']} w{tile['num_warps']} s{tile['num_stages']}{ahead} up {chunk['up']} "
                 f"down {chunk['down']}") if tile and "BN" in tile else \
            f"up {chunk['up']} down {chunk['down']}{ahead}" if chunk else "committed tiles"
        log(f"  {form:<4} {where:<40}: {shown}")


# (name, rows of the first weight, of the second (a pair) or 0, K, groups): the FP8 linears of a decode step
ROWS_SHAPES = [("wq_a+wkv", 1280, 512, 5120, 1), ("wq_b", 32768, 0, 1280, 1), ("wo_a", 1024, 0, 4096, 8),
               ("wo_b", 5120, 0, 8192, 1), ("shared_w1+w3", 2304, 2304, 5120, 1), ("shared_w2", 5120, 0, 2304, 1),
               ("indexer_wq_b", 4096, 0, 1280, 1)]
ROWS_TILES = [dict(BN=bn, BK=bk, num_warps=w, num_stages=1) for bn, bk, w in
              [(32, 256, 4), (16, 256, 4), (64, 256, 4), (32, 128, 4), (32, 512, 4), (16, 512, 4), (64, 128, 4),
               (64, 256, 8), (32, 256, 2)]]
ROWS_TILES += [dict(BN=bn, BK=bk, num_warps=w, num_stages=1, prefetch=True) for bn, bk, w in
               [(64, 256, 4), (64, 128, 4), (32, 256, 4), (32, 128, 4), (64, 256, 8)]]


def sweep_rows() -> None:
    """The decode linears' rows formulation (linear_rows.py) over tilings, split targets and the activations'
    dtype, against the committed tensor-core tiles, at 1 and 6 rows (a step and DSpark's verify) and 8."""
    for name, n, n2, k, groups in ROWS_SHAPES:
        nbytes = (groups * n + n2) * k
        count = copies(nbytes)
        w1, s1 = random_fp8(groups * n, k, count)
        w2, s2 = random_fp8(max(n2, 32), k, count)
        xs = {m: fp8_act_qdq(torch.randn(m, groups * k, device="cuda", dtype=torch.bfloat16)) for m in (1, 6, 8)}
        xf = {m: x.float() for m, x in xs.items()}

        def calls(form, m, tile=None, target=None, fp32=False):
            out = []
            for i in range(count):
                second = (w2[i], s2[i], n2) if n2 else None
                if form == "rows":
                    x = (xf if fp32 else xs)[m]
                    out.append(lambda x=x, i=i, second=second: rows_linear(
                        x, w1[i], s1[i], FMT_FP8_TILE, n, k, torch.bfloat16, groups=groups, tile=tile,
                        split_target=target, second=second))
                else:
                    out.append(lambda i=i, m=m, second=second: run_linear(
                        xs[m], None, w1[i], s1[i], FMT_FP8_TILE, n, k, torch.bfloat16, torch.bfloat16,
                        groups=groups, second=second))
            return out

        results = [(None, None, False, [graph_ms(calls("tiles", m)) for m in (1, 6, 8)])]
        for tile, target, fp32 in itertools.product(ROWS_TILES, (264, 528, 1056), (False, True)):
            if target != 528 and (tile["num_warps"] != 4 or tile["BK"] != 256 or tile.get("prefetch")):
                continue
            try:
                results.append((tile, target, fp32, [graph_ms(calls("rows", m, tile, target, fp32))
                                                     for m in (1, 6, 8)]))
            except Exception as error:
                log(f"  {name} rows {tile} t{target}: failed ({type(error).__name__}: {error})"[:300])
        results.sort(key=lambda r: r[3][0] + r[3][1])
        log(f"\n{name} ({groups} x {n} + {n2}) x {k} fp8: roofline {nbytes / HBM * 1e6:.1f} us")
        for tile, target, fp32, (t1, t6, t8) in results[:10]:
            label = "committed tiles" if tile is None else \
                f"rows BN{tile['BN']} BK{tile['BK']} w{tile['num_warps']}{' pf' if tile.get('prefetch') else ''} " \
                f"t{target} x {'fp32' if fp32 else 'bf16'}"
            log(f"  {label:<38}: M=1 {t1 * 1e3:6.1f} us  M=6 {t6 * 1e3:6.1f} us  M=8 {t8 * 1e3:6.1f} us")
        del w1, s1, w2, s2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--only", choices=("moe", "linears", "rows"))
    args = parser.parse_args()
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    for sweep in (sweep_moe, sweep_linears, sweep_rows):
        if args.only and sweep.__name__ != f"sweep_{args.only}":
            continue
        sweep()
        Path(args.out, "tuning.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
