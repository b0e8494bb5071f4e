"""The indexer's fused scoring kernels against the exact path (the materialized per-head scores): all of a pool's
rows, or each query's candidate blocks (a decode step of a Reindex layer), from key values or a cache's FP4 keys.

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
from modeling_deepseek_v41.kernels.index_scores import StoredKeys, candidate_scores, index_scores  # noqa: E402
from modeling_deepseek_v41.kernels.numerics import e8m0_bytes, fp4_quantize_rows  # noqa: E402
from modeling_deepseek_v41.kernels.triton import candidate_scores as fused_candidate_scores  # noqa: E402
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


def _stored(keys: torch.Tensor, spare: int, seed: int = 1) -> StoredKeys:
    """keys' FP4 codes and E8M0 bytes as a cache stores them, with `spare` rows of other bytes past them."""
    codes, scales = fp4_quantize_rows(keys.double(), 32, "e8m0")
    g = torch.Generator().manual_seed(seed)
    junk = torch.randint(0, 256, (keys.shape[0], spare, codes.shape[-1] + scales.shape[-1]), generator=g,
                         dtype=torch.uint8)
    codes = torch.cat([codes, junk[..., :codes.shape[-1]]], dim=1)
    scales = torch.cat([e8m0_bytes(scales), junk[..., codes.shape[-1]:] % 16 + 120], dim=1)
    return StoredKeys(codes, scales, keys.shape[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_of_stored_keys_equal_those_of_their_values(dtype):
    """A cache's packed keys decoded in the kernel (rows past the visible ones never read) score exactly as the
    unpacked values do, in the kernel and on the exact path."""
    shape = dict(batch=2, seq=40, heads=32, dim=128, rows=300) if CUDA else \
        dict(batch=2, seq=9, heads=3, dim=64, rows=150)
    q, weights, keys, visible = _case(dtype, **shape)
    stored = _stored(keys, spare=37)
    with torch.no_grad():
        assert torch.equal(index_scores(q, weights, stored, visible), index_scores(q, weights, keys, visible))
        on_device = [t.to(DEVICE) for t in (q, weights, keys, visible)]
        packed = (stored.codes.to(DEVICE), stored.scales.to(DEVICE))
        got = fused_index_scores(on_device[0], on_device[1], packed, on_device[3], stored.rows)
        assert torch.equal(got, fused_index_scores(*on_device))


def _blocks(batch, seq, n_blocks, rows, block_size, seed=2):
    """Each query's chosen blocks, ascending, some unused (-1) at the end, one past the pool's visible rows."""
    g = torch.Generator().manual_seed(seed)
    total = -(-rows // block_size)
    blocks = torch.stack([torch.randperm(total, generator=g)[:n_blocks].sort().values
                          for _ in range(batch * seq)]).view(batch, seq, n_blocks)
    blocks[0, 0, -2:] = -1
    return blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_fused_candidate_scores_equal_the_exact_ones(dtype, packed):
    """A decode step's scores of its candidate blocks only (Reindex layers): the fused launch against the exact
    gather-then-score, from values or from a cache's packed keys."""
    shape = dict(batch=2, seq=6, heads=32, dim=128, rows=700) if CUDA else \
        dict(batch=2, seq=3, heads=3, dim=64, rows=150)
    q, weights, keys, visible = _case(dtype, **shape)
    blocks = _blocks(shape["batch"], shape["seq"], 9, shape["rows"], 8)
    source = _stored(keys, spare=5) if packed else keys
    with torch.no_grad():
        ref, ref_positions = candidate_scores(q, weights, source, visible, blocks, 8)  # CPU tensors: exact path
        kernel_keys = (source.codes.to(DEVICE), source.scales.to(DEVICE)) if packed else keys.to(DEVICE)
        out, positions = fused_candidate_scores(*(t.to(DEVICE) for t in (q, weights)), kernel_keys,
                                                *(t.to(DEVICE) for t in (visible, blocks)), 8)
    out, positions = out.cpu(), positions.cpu()
    hidden = ref == -torch.inf
    assert torch.equal(positions, ref_positions) and torch.equal(out == -torch.inf, hidden)
    assert hidden[0, 0].all() and (~hidden).any()  # the padded query sees nothing; others see some candidates
    got, want = out[~hidden].double(), ref[~hidden].double()
    rel = ((got - want).norm() / want.norm()).item()
    if dtype == torch.float64:
        assert rel <= 1e-10
    else:
        assert rel <= 4e-3
        assert (got == want).double().mean() >= 0.9
