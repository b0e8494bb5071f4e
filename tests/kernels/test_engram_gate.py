"""The Engram layer's gated write into the residual streams: one launch against the op's exact path.

In float64 (Triton's interpreter on the CPU) it equals the exact path to 1e-10 relative; in bf16 it differs only
where fp32 summation order moves a rounding. Without a GPU the kernel runs in the interpreter on small shapes."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.engram_gate import engram_gate  # noqa: E402
from modeling_deepseek_v41.kernels.triton import engram_gate as fused_engram_gate  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float64, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_live", [False, True])
def test_fused_engram_gate_equals_the_exact_gate(dtype, with_live):
    batch, seq, hc, dim = (2, 3, 4, 5120) if CUDA else (2, 3, 4, 1100)  # past one column block, not a multiple
    g = torch.Generator().manual_seed(4)
    streams = torch.randn(batch, seq, hc, dim, generator=g).to(dtype)
    projected = (torch.randn(batch, seq, (hc + 1) * dim, generator=g) * 2).to(dtype)
    key, value = projected.split([hc * dim, dim], dim=-1)  # views of one projection, as the layer passes them
    q_weight = (torch.rand(hc, dim, generator=g) + 0.5).to(dtype)
    k_weight = (torch.rand(hc, dim, generator=g) + 0.5).to(dtype)
    live = torch.tensor([[True, False, True], [True, True, False]]) if with_live else None
    with torch.no_grad():
        ref = engram_gate(streams, key, value, q_weight, k_weight, 1e-20, live)
        dev = [t.to(DEVICE) for t in (streams, projected)]
        fused_key, fused_value = dev[1].split([hc * dim, dim], dim=-1)
        out = fused_engram_gate(dev[0], fused_key, fused_value, q_weight.to(DEVICE), k_weight.to(DEVICE), 1e-20,
                                None if live is None else live.to(DEVICE)).cpu()
    assert out.dtype == dtype and out.shape == streams.shape
    if live is not None:  # a dead position's streams pass unchanged
        assert torch.equal(out[0, 1], streams[0, 1]) and torch.equal(ref[0, 1], streams[0, 1])
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    if dtype == torch.float64:
        assert rel <= 1e-10
    else:
        assert rel <= 2.0**-8 and (out == ref).double().mean() >= 0.95
