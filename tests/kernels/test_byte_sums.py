"""The byte-sum kernel behind the prefix cache's weights digest against the portable float64 formulation: the sums
are integers below 2^53, so the two must agree exactly, the remainder chunk included. Without a GPU the kernel
runs in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.cache.fingerprint import HASH_CHUNK, _coefficients  # noqa: E402
from modeling_deepseek_v41.kernels.byte_sums import weighted_byte_sums  # noqa: E402
from modeling_deepseek_v41.kernels.triton import byte_sums  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _bytes(length: int, seed: int) -> torch.Tensor:
    data = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    data[:64] = 255  # the largest products
    return data


def test_byte_sums_equal_the_float64_formulation():
    """Tensors shorter than a chunk, of exactly one, and longer with a remainder, and an empty one, in one call."""
    lengths = [1, HASH_CHUNK - 1, 0, HASH_CHUNK, 3 * HASH_CHUNK + 5]
    tensors = [_bytes(n, seed) for seed, n in enumerate(lengths)]
    expected = weighted_byte_sums(tensors, _coefficients(torch.device("cpu")))
    assert expected.numel() == sum(n // HASH_CHUNK + 1 for n in lengths)
    got = byte_sums([t.to(DEVICE) for t in tensors], _coefficients(torch.device(DEVICE))).cpu()
    assert torch.equal(got, expected)


def test_a_changed_byte_changes_its_chunk_only():
    tensors = [torch.zeros(n, dtype=torch.uint8, device=DEVICE) for n in (5, 2 * HASH_CHUNK)]
    before = byte_sums(tensors, _coefficients(torch.device(DEVICE))).cpu()
    tensors[1][HASH_CHUNK + 7] = 1
    after = byte_sums(tensors, _coefficients(torch.device(DEVICE))).cpu()
    assert torch.equal(after != before, torch.tensor([False, False, True, False]))


def test_the_weights_digest_is_the_same_through_the_kernel():
    """A model's chunk-sums digest through the one-launch kernel equals the portable formulation's (on the GPU:
    the digest a cache saved there stores, against one computed on the CPU)."""
    from model_factory import random_model

    from modeling_deepseek_v41.cache.fingerprint import weights_digest
    model = random_model(dtype=torch.bfloat16)
    portable = weights_digest(model, method="chunk-sums")
    if CUDA:
        assert weights_digest(model.cuda()) == portable
    else:  # the kernel in the interpreter, fed as the CUDA path feeds it
        from modeling_deepseek_v41.cache import fingerprint
        parameters = [p for _, p in fingerprint.kv_producing_parameters(model)]
        assert torch.equal(byte_sums(parameters, _coefficients(torch.device("cpu"))),
                           weighted_byte_sums(parameters, _coefficients(torch.device("cpu"))))
