"""Engram's n-gram hashing in one launch gives the exact path's table rows (integer math: equal), with look-back
blocked at the history's start and at dead ids. Without a GPU the kernel runs in the interpreter."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels.engram_hash import DEAD, engram_hash_ids, ngram_window  # noqa: E402
from modeling_deepseek_v41.kernels.triton import engram_rows  # noqa: E402
from modeling_deepseek_v41.layers.engram_hashing import EngramHashLayout, engram_table_rows  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("width", [1, 4, 9])
def test_fused_engram_rows_equal_the_exact_rows(width):
    config = SimpleNamespace(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8,
                             engram_vocab_size=160_000, engram_compressed_vocab_size=99_092)
    config.engram_num_embeddings = engram_table_rows(config)
    primes, offsets, multipliers = EngramHashLayout.from_config(config).tensors
    g = torch.Generator().manual_seed(width)
    history = torch.randint(0, 99_092, (3, 11), generator=g)
    history[0, 6] = DEAD  # an image span or padding cuts the n-grams reaching back over it
    history[1, -1] = DEAD
    pad = torch.tensor(7)
    want = engram_hash_ids(ngram_window(history, pad, 4, width), primes, offsets, multipliers)
    got = engram_rows(history.to(DEVICE), pad.to(DEVICE), 4, width, primes.to(DEVICE), offsets.to(DEVICE),
                      multipliers.to(DEVICE)).cpu()
    assert got.shape == want.shape == (3, width, 2, 24)
    assert torch.equal(got, want)
