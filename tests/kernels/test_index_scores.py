"""The indexer's fused scoring kernel against the exact path (the materialized per-head scores).

In float64 (Triton's interpreter on the CPU, the same program the GPU compiles) it equals the exact path to 1e-10
relative; in bf16 it rounds where the exact path rounds, so it differs only by fp32 summation order. Without a GPU
the kernel runs in the interpreter on small shapes, with one the same checks run compiled at the released widths.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.fp4_rows import fp4_qdq  # noqa: E402
from modeling_deepseek_v41.kernels.index_scores import index_scores  # noqa: E402
from modeling_deepseek_v41.kernels.triton import index_scores as fused_index_scores  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16] if CUDA else [torch.float64, torch.bfloat16]


def _case(dtype, batch, seq, heads, dim, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = fp4_qdq(torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64), 32, "e8m0").to(dtype)
    keys = fp4_qdq(torch.randn(batch, rows, dim, generator=g, dtype=torch.float64), 32, "e8m0").to(dtype)
    weights = (torch.randn(batch, seq, heads, generator=g) * heads**-0.5).to(dtype)
    # queries of a chunk that starts past row 0, one padded query (sees nothing), and one batch row shorter
    visible = (torch.arange(seq) + rows - seq + 1).clamp(0, rows).repeat(batch, 1)
    visible[0, 0] = 0
    visible[-1] = (visible[-1] - rows // 2).clamp_min(0)
    return q, weights, keys, visible


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_index_scores_equal_the_exact_scores(dtype):
    shape = dict(batch=2, seq=300, heads=32, dim=128, rows=700) if CUDA else \
        dict(batch=2, seq=70, heads=3, dim=64, rows=300)
    q, weights, keys, visible = _case(dtype, **shape)
    with torch.no_grad():
        ref = index_scores(q, weights, keys, visible)  # CPU tensors: the exact path
        out = fused_index_scores(*(t.to(DEVICE) for t in (q, weights, keys, visible))).cpu()
    hidden = ref == -torch.inf
    assert torch.equal(out == -torch.inf, hidden) and hidden[0, 0].all()
    assert hidden.any(dim=-1).all() or visible.max() == shape["rows"]
    got, want = out[~hidden].double(), ref[~hidden].double()
    rel = ((got - want).norm() / want.norm()).item()
    if dtype == torch.float64:
        assert rel <= 1e-10
    else:  # each score rounded to bf16 after a sum of another order: at most an ulp apart, mostly equal
        assert rel <= 4e-3
        assert (got == want).double().mean() >= 0.9
