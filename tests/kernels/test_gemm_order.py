"""The fp32 GEMM summation order the parity tests rely on (pinned by MKL_CBWR in conftest.py, see docs/model.md).

The reference's hc-mix projection sums K in blocks of 192, each a sequential FMA chain, the blocks added in order:
MKL's AVX2 kernels. If the pin is lost (another BLAS, MKL's AVX-512 kernels) this test names the cause directly.
"""

from __future__ import annotations

import os

import pytest
import torch

from modeling_deepseek_v41.kernels.linear import row_invariant_linear
from reference_numerics import fma_blocks

@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="the pinned order is MKL's")
def test_hc_mix_projection_sums_in_the_reference_order():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 512, generator=gen).bfloat16().float()  # streams are bf16 values
    w = torch.randn(24, 512, generator=gen) * 0.05
    assert torch.equal(row_invariant_linear(x, w), fma_blocks(x, w)), f"MKL_CBWR={os.environ.get('MKL_CBWR')}"
