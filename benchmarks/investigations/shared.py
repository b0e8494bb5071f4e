"""What the tensor-core investigation (fp4_mma/) uses: the offline sm_90 compile of a Gluon kernel (the H200's
Triton 3.6 wheel in /tmp/t36, first on sys.path), the slice orders (which column a lane's value multiplies) and
their device-cached column index, the activations' QDQ written straight into a slice order, and the split of a
slice's four 32-column groups.

A kernel's lane t holds, per 32-column group g of a 128-column slice, 8 values i of a weight row; its activations
are read at position 32 t + 8 g + i of the slice. The order says which column that is: NATURAL, 32 g + 8 t + i,
the shipped bytes as they are (the package's common.mma_position); FP4_WORDS, the weights permuted once at load so
that a lane's values of a slice are one 16-byte load."""

from __future__ import annotations

import inspect
import os
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from modeling_deepseek_v41.kernels.triton.common import qdq_groups

NV = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin") + "/"


def gluon_sass(fn, types: dict, const: dict, out: str, divisible=("N", "K", "k_chunk"), num_warps: int = 4) -> None:
    """Compile `fn` for sm_90 with these argument types and constexprs, write its SASS to `out`, print its
    registers and shared memory."""
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


NATURAL, FP4_WORDS = 0, 1  # the slice orders


def lane_columns(order: int) -> torch.Tensor:
    """[4, 8]: the column within its group that lane t's value i multiplies, in an order."""
    t = torch.arange(4)[:, None]
    i = torch.arange(8)[None, :]
    if order == NATURAL:
        return 8 * t + i
    return ((i >> 1) & 1) + 2 * t + 8 * (i & 1) + 16 * (i >> 2)  # nibbles 0 and 2, 1 and 3, ... k's neighbours


def slice_permutation(k: int, order: int) -> torch.Tensor:
    """[K]: the column that position 32 t + 8 g + i of each 128-column slice holds in an order."""
    if k % 128:
        raise ValueError(f"K ({k}) must be a multiple of 128")
    within = (32 * torch.arange(4)[None, :, None] + lane_columns(order)[:, None, :]).reshape(-1)  # [t, g, i]
    return (torch.arange(0, k, 128)[:, None] + within[None, :]).reshape(-1)


_ON_DEVICE: dict = {}


def permuted_columns(x, order: int):
    """x [..., K] with its columns in an order's positions, the index kept on x's device (a CUDA graph can record
    the call)."""
    key = (order, x.shape[-1], x.device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = slice_permutation(x.shape[-1], order).to(x.device)
    return x.index_select(-1, _ON_DEVICE[key]).contiguous()


@triton.jit
def slice_position(c, ORDER: tl.constexpr):
    """The position of column c in an order (the inverse of slice_permutation): group g = c % 128 // 32 of its
    slice, lane t and value i from j = c % 32 as lane_columns(ORDER) assigns them, at 32 t + 8 g + i."""
    j = c % 32
    if ORDER == 0:  # NATURAL
        t = j >> 3
        i = j & 7
    else:  # FP4_WORDS
        t = (j >> 1) & 3
        i = 4 * (j >> 4) + 2 * (j & 1) + ((j >> 3) & 1)
    return (c // 128) * 128 + 32 * t + 8 * ((c % 128) // 32) + i


@triton.jit
def _act_quant_permuted_kernel(x_ptr, q_ptr, s_ptr, n_groups, groups_per_row, stride_xm, GROUPS: tl.constexpr,
                               ORDER: tl.constexpr):
    """The FP8 activation QDQ per 32 values (qdq_groups, as quant._act_quant_kernel: e4m3 values in fp16, fp32
    scales), the values stored at their columns' positions in an order."""
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    valid = g < n_groups
    row = g // groups_per_row
    col = (g % groups_per_row)[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_xm + col, mask=valid[:, None], other=0.0).to(tl.float32)
    codes, scale = qdq_groups(tl.reshape(x, [GROUPS * 32]), GROUPS * 32)
    tl.store(q_ptr + row[:, None] * (groups_per_row * 32) + slice_position(col, ORDER),
             tl.reshape(codes, [GROUPS, 32]).to(tl.float16), mask=valid[:, None])
    tl.store(s_ptr + g, scale, mask=valid)


def act_quant_permuted(x: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [M, K] in fp16 in an order's positions, fp32 scales [M, K/32]) of x [M, K], in one launch."""
    m, k = x.shape
    x = x.contiguous()
    codes = torch.empty(m, k, dtype=torch.float16, device=x.device)
    scales = torch.empty(m, k // 32, dtype=torch.float32, device=x.device)
    n_groups = m * k // 32
    _act_quant_permuted_kernel[(triton.cdiv(n_groups, 16),)](x, codes, scales, n_groups, k // 32, x.stride(0),
                                                              GROUPS=16, ORDER=order)
    return codes, scales


@gluon.jit
def split_groups(t):
    """A slice's four 32-column groups on t's last two axes [2, 2] (group 2a + b at [a, b]) -> the four groups'
    tensors, in order."""
    even, odd = gl.split(t)  # groups 0 and 2, 1 and 3
    g0, g2 = gl.split(even)
    g1, g3 = gl.split(odd)
    return g0, g1, g2, g3
