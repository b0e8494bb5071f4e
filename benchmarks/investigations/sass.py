"""Offline sm_90 compile of a Triton kernel; SASS instruction histogram (not committed)."""
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, signature, constexprs, num_warps=4, num_stages=3, not_div16=("M", "splits", "P", "R", "S")):
    """signature: the runtime args' types; every pointer and int not in not_div16 is marked divisible by 16 (as the
    launcher specializes aligned arguments)."""
    names = fn.arg_names
    full = {}
    attrs = {}
    for i, name in enumerate(names):
        if name in signature:
            full[name] = signature[name]
            if name not in not_div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            full[name] = "constexpr"
    consts = dict(constexprs)
    for i, name in enumerate(names):
        if name not in signature and name not in consts:
            consts[name] = fn.params[i].default
    src = ASTSource(fn, signature=full, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                num_stages=num_stages))


def sass(kernel):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    os.unlink(path)
    return out


def histogram(text):
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return ops


def report(kernel, label):
    text = sass(kernel)
    ops = histogram(text)
    md = kernel.metadata
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    print(f"{label}: {sum(ops.values())} SASS instr, regs {regs and regs.group(1)}, stack {stack and stack.group(1)}, "
          f"smem {md.shared}")
    print("   ", ", ".join(f"{k} {v}" for k, v in ops.most_common(25)))
    return text


def loop_bodies(text):
    """(start, end, instructions) of each backward-branch loop in the SASS text, largest first."""
    lines = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, ins in lines:
        b = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins) or re.search(r"BRA.*?0x([0-9a-f]+)", ins)
        if b:
            target = int(b.group(1), 16)
            if target < addr:
                body = [i for a, i in lines if target <= a <= addr]
                loops.append((target, addr, body))
    loops.sort(key=lambda l: -len(l[2]))
    return loops


def loop_report(kernel, label, bytes_per_iter):
    text = sass(kernel)
    for start, end, body in loop_bodies(text)[:2]:
        ops = collections.Counter(re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", i).group(2) for i in body)
        print(f"{label}: loop {len(body)} instr -> {len(body) * 128 / bytes_per_iter:.2f} thread-instr per weight byte "
              f"(4 warps)   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
    return text
