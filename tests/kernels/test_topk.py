"""The radix-select top-k (kernels/triton/topk.py) chooses the positions a stable descending sort puts first.

Ties (many equal scores, -0.0 against +0.0), rows of -inf, NaN, widths below, at and past one block, bf16, fp16 and
fp32 scores, with and without dropping the unreachable (-inf) picks. Without a GPU the kernel runs in Triton's
interpreter (the same program the GPU compiles); with one the same cases run compiled, plus the released widths.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.sparse_attention import stable_topk_indices, topk_ascending  # noqa: E402
from modeling_deepseek_v41.kernels.triton import topk_ascending as kernel_topk_ascending  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
SHAPES = [(1, 1), (7, 3), (300, 64), (2048, 512), (5000, 512)] + ([(65536, 512), (8192, 2048)] if CUDA else [])


def _scores(width: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    s = torch.randn(4, width, generator=g)
    s[0, : width // 2] = torch.round(s[0, : width // 2] * 2) / 2  # many exact ties
    s[1, width // 3:] = -torch.inf  # fewer finite scores than k in the short rows
    if width > 5:
        s[2, 1], s[2, 4], s[2, 2] = -0.0, 0.0, torch.nan
    s[2, width // 2:] = s[2, 0]
    s[3] = s[3].abs()
    return s.to(dtype)


def _sorted_selection(scores: torch.Tensor, k: int, drop: bool) -> torch.Tensor:
    """The definition: a stable descending sort's first k positions, in ascending order."""
    chosen = stable_topk_indices(scores, k)
    if drop:
        width = scores.shape[-1]
        chosen = torch.where(scores.gather(-1, chosen) > -torch.inf, chosen, width)
        chosen = chosen.sort(dim=-1).values
        return torch.where(chosen == width, -1, chosen)
    return chosen.sort(dim=-1).values


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width,k", SHAPES)
def test_the_kernel_chooses_what_a_stable_sort_puts_first(width, k, dtype, drop):
    scores = _scores(width, dtype)
    want = _sorted_selection(scores, k, drop)
    got = kernel_topk_ascending(scores.to(DEVICE), k, drop).cpu()
    assert torch.equal(got, want)


def test_the_op_keeps_the_sort_formulation_off_the_kernel_path():
    scores = _scores(300, torch.float64)
    assert torch.equal(topk_ascending(scores, 64, True), _sorted_selection(scores, 64, True))
    assert torch.equal(topk_ascending(scores, 64), _sorted_selection(scores, 64, False))


def test_a_k_outside_the_row_is_refused_before_any_launch():
    with pytest.raises(ValueError, match="0 < k <= 5"):
        kernel_topk_ascending(torch.zeros(2, 5, device=DEVICE), 6, False)
