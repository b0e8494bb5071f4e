"""FP4 rows after rotating their RoPE tail in the same launch (the index queries' QDQ, the index keys and the
compressed KV rows), against the exact rotation then the exact quantization.

The rotation's products may round otherwise than torch's complex product (fused multiply-adds), so a rotated value
may differ from the exact one by its dtype's last bit (in fp32 often: 3% of values on the H200) and its FP4 code
then fall on the other side of a boundary: rare. In float64 the rotated values equal the exact ones to 1e-10 relative."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels import numerics  # noqa: E402
from modeling_deepseek_v41.kernels.rope import apply_rope_tail  # noqa: E402
from modeling_deepseek_v41.kernels.triton import fp4_rows  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] + ([] if CUDA else [torch.float64])


def _case(dtype, lead, dim, rope_dim, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, dim, generator=g) * 3).to(dtype)
    angles = torch.rand(*lead[:2], rope_dim // 2, generator=g, dtype=torch.float64) * 50
    return x, torch.polar(torch.ones_like(angles), angles).to(torch.complex128 if dtype == torch.float64
                                                               else torch.complex64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, dim, rope_dim, block, scale_format", [
    ((2, 3, 5), 128, 64, 32, "e8m0"),  # index queries: [B, S, H, HD], one rotation per (b, s) for every head
    ((2, 4), 128, 64, 32, "e8m0"),  # index keys: [B, G, HD]
    ((2, 4), 512, 64, 16, "e4m3"),  # compressed KV rows
], ids=["queries", "keys", "pool"])
def test_rotated_fp4_rows_equal_the_exact_rotation_then_quantization(dtype, lead, dim, rope_dim, block,
                                                                     scale_format):
    x, rotation = _case(dtype, lead, dim, rope_dim)
    rotated = apply_rope_tail(x, rotation, rope_dim)
    qdq = numerics.fp4_qdq(rotated, block, scale_format)
    codes, scales = numerics.fp4_quantize_rows(rotated, block, scale_format)
    got_qdq = fp4_rows(x.to(DEVICE), block, scale_format, packed=False, rotation=rotation.to(DEVICE),
                       rope_dim=rope_dim).cpu()
    got_rotated, got_codes, got_scales = (t.cpu() for t in fp4_rows(
        x.to(DEVICE), block, scale_format, packed=True, rotation=rotation.to(DEVICE), rope_dim=rope_dim))
    assert got_qdq.dtype == dtype and got_rotated.dtype == dtype
    assert torch.equal(got_rotated[..., :-rope_dim], x[..., :-rope_dim])  # the head passes untouched
    tail_rel = ((got_rotated.double() - rotated.double()).norm() / rotated.double().norm()).item()
    if dtype == torch.float64:
        assert tail_rel <= 1e-10
    elif dtype == torch.float32:  # fp32 rounding of fused or separate products: last bits (3% of values, H200)
        assert tail_rel <= 2.0**-21
    else:
        assert (got_rotated != rotated).double().mean() <= 0.02
    assert (got_qdq != qdq).double().mean() <= 0.02
    assert (got_codes != codes).double().mean() <= 0.02 and (got_scales != scales).double().mean() <= 0.02
    # what the kernel rotated, it quantized exactly as the numerics quantize those values
    assert torch.equal(got_qdq, numerics.fp4_qdq(got_rotated, block, scale_format))
    expected_codes, expected_scales = numerics.fp4_quantize_rows(got_rotated, block, scale_format)
    assert torch.equal(got_codes, expected_codes) and torch.equal(got_scales, expected_scales)
