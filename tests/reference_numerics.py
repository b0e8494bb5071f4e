"""Whether this process's CPU kernels round like those of the machine that produced the fixtures.

The fixtures' reference ran on an AMD EPYC: MKL's AVX2 sgemm kernels (K summed in blocks of 192, each a sequential
FMA chain) and MKL's generic vector-math branch for torch.exp, the branch MKL_CBWR=COMPATIBLE selects on an Intel
CPU. On an Intel CPU one MKL_CBWR value selects both: AVX2,STRICT gives the reference's sgemm order but the AVX2
exp, which rounds about 4% of fp32 inputs differently; the softmax and Sinkhorn exps then move a few bf16 roundings
(docs/model.md). The bit-exact parity checks run where both hold; elsewhere the fixture README's loose bounds apply.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import torch

from modeling_deepseek_v41.kernels.linear import row_invariant_linear

GEMM_BLOCK = 192
_EXP_PROBE = "import torch,sys; g=torch.Generator().manual_seed(0); x=torch.randn(200000,generator=g)*8; " \
             "sys.stdout.buffer.write(torch.exp(x).numpy().tobytes())"


def fma_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M,K] @ w[N,K]^T: per K block a sequential fp32 FMA chain (products of bf16 x fp32 are exact in float64)."""
    xd, wd = x.double(), w.double()
    total = None
    for start in range(0, x.shape[1], GEMM_BLOCK):
        acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
        for k in range(start, min(start + GEMM_BLOCK, x.shape[1])):
            acc = (acc.double() + xd[:, k:k + 1] * wd[:, k]).float()
        total = acc if total is None else total + acc
    return total


def gemm_sums_like_reference() -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 512, generator=gen).bfloat16().float()  # hc streams are bf16 values
    w = torch.randn(24, 512, generator=gen) * 0.05
    return torch.equal(row_invariant_linear(x, w), fma_blocks(x, w))


def _exp_bytes(env: dict[str, str]) -> bytes:
    return subprocess.run([sys.executable, "-c", _EXP_PROBE], env=env, capture_output=True, check=True).stdout


@functools.cache
def exp_rounds_like_reference() -> bool:
    """torch.exp here equals MKL's generic-branch exp (run in a child with MKL_CBWR=COMPATIBLE) on a probe."""
    if not torch.backends.mkl.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    mine = torch.exp(torch.randn(200000, generator=g) * 8).numpy().tobytes()
    return mine == _exp_bytes({**os.environ, "MKL_CBWR": "COMPATIBLE"})


@functools.cache
def kernels_round_like_reference() -> bool:
    return torch.backends.mkl.is_available() and gemm_sums_like_reference() and exp_rounds_like_reference()
