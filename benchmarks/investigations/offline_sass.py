"""Shared by the investigations: compile a Gluon kernel for sm_90 without a GPU (the H200's Triton 3.6 wheel in
/tmp/t36, first on sys.path) and write its SASS, with the launcher's divisibility hints for pointers, strides and
the sizes named in `divisible`."""

from __future__ import annotations

import inspect
import subprocess
import tempfile

NV = "/tmp/t36/triton/backends/nvidia/bin/"


def gluon_sass(fn, types: dict, const: dict, out: str, divisible=("N", "K", "k_chunk"), num_warps: int = 4) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = list(inspect.signature(fn.fn).parameters)
    sig = {a: ("constexpr" if a in const else types.get(a, "i32")) for a in names}
    div = {(names.index(a),): [["tt.divisibility", 16]] for a in names
           if sig[a] != "constexpr" and (sig[a].startswith("*") or a.startswith("stride") or a in divisible)}
    kernel = triton.compile(GluonASTSource(fn, sig, const, div), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    open(out, "w").write(subprocess.run([NV + "nvdisasm", "-c", f.name], capture_output=True, text=True).stdout)
    usage = subprocess.run([NV + "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    print([line.strip() for line in usage.splitlines() if "REG" in line], "shared", kernel.metadata.shared)


_ON_DEVICE: dict = {}


def permuted_columns(x, permutation):
    """x [..., K] with its columns in permutation(K)'s order, the index kept on x's device (a CUDA graph can record
    the call)."""
    key = (permutation, x.shape[-1], x.device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = permutation(x.shape[-1]).to(x.device)
    return x.index_select(-1, _ON_DEVICE[key]).contiguous()
