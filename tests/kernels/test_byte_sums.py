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


def _digest_as_first_written(model) -> str:
    """The chunk-sums digest as the first saved caches computed it (every parameter's bytes widened to float64),
    so that caches saved before stay restorable."""
    import hashlib

    from modeling_deepseek_v41.cache import fingerprint
    parameters = fingerprint.kv_producing_parameters(model)
    digest = hashlib.sha256()
    for name, parameter in parameters:
        digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype};".encode())
    weights = _coefficients(torch.device("cpu")).double()
    for _, parameter in parameters:
        data = parameter.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        whole = data.numel() - data.numel() % HASH_CHUNK
        chunks = data[:whole].view(-1, HASH_CHUNK).double() @ weights
        tail = data[whole:].double() @ weights[:data.numel() - whole]
        digest.update(torch.cat([chunks, tail.reshape(1)]).numpy().tobytes())
    return "chunk-sums:" + digest.hexdigest()


def test_the_weights_digest_is_the_same_through_the_kernel(monkeypatch):
    """A model's chunk-sums digest through the one-launch kernel (on the GPU: the digest a cache saved there stores;
    on the CPU: the kernel in the interpreter, fed as the CUDA path feeds it) equals the portable formulation's and
    the first formulation's."""
    from model_factory import random_model

    from modeling_deepseek_v41.cache import fingerprint
    model = random_model(dtype=torch.bfloat16)
    first = _digest_as_first_written(model)
    assert fingerprint.weights_digest(model, method="chunk-sums") == first
    if CUDA:
        model = model.cuda()
    else:
        monkeypatch.setattr(fingerprint, "weighted_byte_sums", byte_sums)
    assert fingerprint.weights_digest(model, method="chunk-sums") == first


def test_sums_of_several_devices_go_to_the_digest_in_name_order():
    from modeling_deepseek_v41.cache.fingerprint import in_name_order
    sums = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0, 6.0])}
    ordered = in_name_order(["a", "b", "a"], {"a": [2, 1], "b": [3]}, sums)
    assert ordered.tolist() == [1.0, 2.0, 4.0, 5.0, 6.0, 3.0]
