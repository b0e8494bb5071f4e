"""Compile the package's tensor-core decode kernels for sm_90 without a GPU and count their instructions.

    python benchmarks/offline_sass.py [--triton DIR] [--out DIR]

For each Gluon kernel (fp4_mma, fp8_mma, dense_mma) and block size: its registers and shared memory, and the instruction
mix of its main loop (the largest SASS loop holding the MMAs: a backward branch and its target, from the Triton wheel's
own nvdisasm). `--triton` puts another Triton first on the path (e.g. the GPU machine's version unpacked with `pip
install --no-deps --target DIR triton==3.6.0`). The offline counts in results.md come from here; what they cannot say is
the time, which the GPU measures (`mma_ab_gpu.sh`).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_sass(fn, types: dict, const: dict, num_warps: int = 4, gluon: bool = True) -> tuple[str, str, int]:
    """(SASS listing, resource line, shared bytes) of a Gluon kernel (or, gluon=False, a Triton one, unpipelined)
    compiled for sm_90 with these argument types and constexprs; pointers, strides and K-like sizes get the JIT's
    divisibility-by-16 specialization."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    names = list(inspect.signature(fn.fn).parameters)
    sig = {a: ("constexpr" if a in const else types.get(a, "i32")) for a in names}
    aligned = [a for a in names if sig[a] != "constexpr"
               and (sig[a].startswith("*") or a.startswith("stride") or a in ("N", "K", "k_chunk"))]
    div = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source, options = (GluonASTSource, {}) if gluon else (ASTSource, {"num_stages": 1})
    kernel = triton.compile(source(fn, sig, const, div), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, **options})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                           text=True).stdout
    os.unlink(f.name)
    resources = " ".join(line.strip() for line in usage.splitlines() if "REG" in line)
    return sass, resources, kernel.metadata.shared


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(instruction count, opcode mix) of each loop: the instructions from a backward branch's target to it."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if op:
            instructions.append(op.group(2).strip())
    found = []
    for i, text in enumerate(instructions):
        branch = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if branch and labels.get(branch.group(1), 1 << 30) < i:
            body = instructions[labels[branch.group(1)]:i + 1]
            found.append((len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0]
                                                          for b in body)))
    return found


def kernels():
    """(name, Gluon kernel, argument types, constexprs) of each variant the package launches."""
    from modeling_deepseek_v41.kernels.triton import dense_mma, fp4_mma, fp8_mma
    fp4 = {"x_ptr": "*fp16", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*fp32",
           "pair_ptr": "*i32", "block_expert_ptr": "*i32", "block_start_ptr": "*i32", "block_end_ptr": "*i32",
           "w2_ptr": "*i32", "s2_ptr": "*u8"}
    fp8 = {"x_ptr": "*fp16", "xs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "count_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8", "out2_ptr": "*bf16"}
    for bm, prefetch in ((8, False), (8, True), (16, False), (32, False)):
        yield (f"fp4_mma (FP4 experts, per 128-column slice), {bm} rows{', prefetch' if prefetch else ''}",
               fp4_mma._fp4_mma_kernel, fp4, {"BN": 128, "BM": bm, "WORD_ASM": fp4_mma._FP4_WORD_ASM.value,
                                              "ROWS_ARE_TOKENS": False, "PREFETCH": prefetch})
    for prefetch in (False, True):
        yield (f"fp8_mma (FP8 linears, per 128-column slice), 8 rows QDQ'd inside{', prefetch' if prefetch else ''}",
               fp8_mma._fp8_mma_kernel, dict(fp8, x_ptr="*bf16"), {"BN": 128, "BM": 8, "QDQ": True,
                                                                    "PREFETCH": prefetch})
    for bm in (8, 16, 32):
        yield (f"fp8_mma (FP8 linears, per 128-column slice), {bm} rows", fp8_mma._fp8_mma_kernel, fp8,
               {"BN": 128, "BM": bm, "QDQ": False, "PREFETCH": False})
    for weight, pieces, out in (("fp32", 3, "fp32"), ("bf16", 1, "bf16")):
        dense = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "out_ptr": f"*{out}", "part_ptr": "*fp32",
                 "count_ptr": "*i32", "w2_ptr": f"*{weight}", "out2_ptr": f"*{out}"}
        for bm in (8, 32):
            yield (f"dense_mma ({weight} weights, per 32-column group), {bm} rows", dense_mma._dense_mma_kernel,
                   dense, {"BN": 128, "BM": bm, "PIECES": pieces})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton", type=Path, help="a directory holding another Triton, put first on the path")
    parser.add_argument("--out", type=Path, help="also write each kernel's SASS listing here")
    args = parser.parse_args()
    sys.path[:0] = ([str(args.triton)] if args.triton else []) + [str(ROOT)]
    import triton
    print(f"Triton {triton.__version__}, sm_90")
    for name, fn, types, const in kernels():
        sass, resources, shared = compile_sass(fn, types, const)
        main_loop = max((loop for loop in loops(sass) if loop[1]["HMMA"]), key=lambda loop: loop[0])
        mix = ", ".join(f"{op} {n}" for op, n in main_loop[1].most_common(10))
        print(f"{name}: {resources} shared {shared}\n    main loop {main_loop[0]} instructions: {mix}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / (re.sub(r"\W+", "_", name).strip("_") + ".sass")).write_text(sass)


if __name__ == "__main__":
    main()
