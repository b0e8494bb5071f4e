"""FP8 / FP4 formats: quantize, dequantize, pack, unpack and fake-quantize (QDQ).

Fake-quantization passes gradients straight through (the identity's gradient), so training goes through the
same QDQ steps as inference.

The only module that knows the bit formats. Conventions follow the official reference:
- FP8 values are e4m3 (round to nearest even, saturating at +-448); scales are E8M0 powers of two or E4M3.
- FP4 values are e2m1 (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), two codes per byte, even element in the low nibble.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
WEIGHT_BLOCK = 32  # FP8 weights: one scale per 32x32 tile; FP4 weights and activations: per 32 values
POOL_KV_BLOCK = 16  # compressed KV rows: FP4 values with an E4M3 scale per 16
INDEX_BLOCK = 32  # index queries and keys: FP4 values with an E8M0 scale per 32


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a dense parameter is created in: the reference's, or float64 when the model is built under a
    float64 default dtype (`from_pretrained(..., dtype=torch.float64)`, exact-semantics tests)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else dtype


def compute_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """The accumulation dtype (of a tensor, or for a dtype) the reference uses fp32 for; float64 stays float64."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def straight_through(x: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """The quantized value forward, the identity's gradient backward (a straight-through estimator).

    `quantized + (x - x.detach())` adds an exact zero, so the forward value is bit-identical to `quantized`.
    """
    if not x.requires_grad:
        return quantized
    return quantized + (x - x.detach()).to(quantized.dtype)


def _pow2_ceil_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """2^ceil(log2(amax / max_value)) from the IEEE bits of the fp32 product amax * fp32(1/max_value)."""
    product = (amax.float() * torch.tensor(1.0 / max_value, dtype=torch.float32)).contiguous()
    bits = product.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 e4m3 (nearest even), saturating instead of overflowing to NaN."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_act_qdq(x: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """The reference's FP8 activation fake-quantization: per `block` values, power-of-two scale, e4m3 values."""
    groups = x.float().unflatten(-1, (-1, block))
    scale = _pow2_ceil_scale(groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4), FP8_MAX)
    quantized = to_e4m3(groups / scale).float() * scale
    return straight_through(x, quantized.flatten(-2).to(x.dtype))


def fp8_quantize_rows(x: torch.Tensor, block: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and E8M0 scales per `block` values along the last dim (window KV storage)."""
    groups = x.float().unflatten(-1, (-1, block))
    scale = _pow2_ceil_scale(groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4), FP8_MAX)
    return to_e4m3(groups / scale).flatten(-2), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of E8M0 scales given as float8_e8m0fnu or as their uint8 bytes: 2^(byte - 127), bit-exact (0xFF
    is NaN). Bytes are decoded by integer shifts into fp32 exponent bits: Inductor has no C++ type for E8M0."""
    if scales.dtype != torch.uint8:
        return scales.float()
    bits = scales.to(torch.int32) << 23
    bits = torch.where(scales == 0, 0x400000, bits | (scales == 0xFF).to(torch.int32))  # 2^-127 is subnormal
    return bits.view(torch.float32)


def e8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """The uint8 E8M0 bytes of power-of-two scales (fp32 or float8_e8m0fnu): their fp32 exponent field."""
    return ((scales.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def fp8_dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    groups = values.float().unflatten(-1, (scales.shape[-1], -1)) * e8m0_to_float(scales).unsqueeze(-1)
    return groups.flatten(-2).to(dtype)


def _e2m1_magnitudes(codes: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes of 3-bit e2m1 codes (0, .5, 1, 1.5, 2, 3, 4, 6), computed rather than looked up in a host
    table: copying a table to the device in every call would stop a CUDA graph from capturing the step."""
    exponent = codes.to(torch.int32) >> 1
    mantissa = (codes & 1).to(torch.float32)
    normal = torch.ldexp(1.0 + 0.5 * mantissa, exponent - 1)
    return torch.where(exponent == 0, 0.5 * mantissa, normal)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (bit 3 = sign) of fp32 values already scaled into [-6, 6], nearest-even rounding."""
    grid = _e2m1_magnitudes(torch.arange(8, device=v.device))
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact: 0.25, 0.75, ..., 5
    magnitude = v.abs()
    code = torch.bucketize(magnitude, midpoints, right=False)
    # at an exact midpoint bucketize rounds down; nearest-even rounds up where the upper code is even
    tie_up = (magnitude.unsqueeze(-1) == midpoints[1::2]).any(-1)
    code = code + tie_up.to(code.dtype)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit e2m1 codes (negative zero kept)."""
    magnitude = _e2m1_magnitudes(codes & 0x7)
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> uint8 bytes [..., K/2], the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8/int8 bytes [..., K/2] -> uint8 codes [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _fp4_scale(amax: torch.Tensor, scale_format: str) -> torch.Tensor:
    if scale_format == "e4m3":
        return to_e4m3(amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).float()
    if scale_format == "e8m0":
        return _pow2_ceil_scale(amax.clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    raise ValueError(f"unknown FP4 scale format {scale_format!r}; expected 'e4m3' or 'e8m0'")


def fp4_quantize_rows(x: torch.Tensor, block: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 bytes [..., K/2] (uint8) and scales [..., K/block] (fp32 values of the scale format)."""
    groups = x.float().unflatten(-1, (-1, block))
    scale = _fp4_scale(groups.abs().amax(dim=-1, keepdim=True), scale_format)
    codes = e2m1_codes((groups / scale).clamp(-FP4_MAX, FP4_MAX))
    return pack_nibbles(codes.flatten(-2)), scale.squeeze(-1)


def fp4_dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = e2m1_values(unpack_nibbles(packed)).unflatten(-1, (scales.shape[-1], -1))
    return (values * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def fp4_qdq(x: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    """FP4 fake-quantization: E4M3 scales per 16 (compressed KV) or E8M0 scales per 32 (index q and k)."""
    groups = x.float().unflatten(-1, (-1, block))
    scale = _fp4_scale(groups.abs().amax(dim=-1, keepdim=True), scale_format)
    rounded = e2m1_values(e2m1_codes((groups / scale).clamp(-FP4_MAX, FP4_MAX)))
    return straight_through(x, (rounded * scale).flatten(-2).to(x.dtype))


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 e4m3 [N, K] with E8M0 scales per 32x32 tile [ceil(N/32), ceil(K/32)] -> dense (exact in fp32/bf16)."""
    n, k = weight.shape
    tile_scale = scale.float().repeat_interleave(WEIGHT_BLOCK, 0)[:n].repeat_interleave(WEIGHT_BLOCK, 1)[:, :k]
    return (weight.float() * tile_scale).to(dtype)


def dequantize_fp4_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed FP4 [N, K/2] (int8 storage) with E8M0 scales per (row, 32 inputs) [N, K/32] -> dense."""
    return fp4_dequantize_rows(weight, scale, dtype)


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> FP8 e4m3 and E8M0 32x32 tile scales, the checkpoint's storage format."""
    n, k = weight.shape
    w = weight.float()
    pad_n, pad_k = -n % WEIGHT_BLOCK, -k % WEIGHT_BLOCK
    tiles = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)).unflatten(0, (-1, WEIGHT_BLOCK)).unflatten(
        -1, (-1, WEIGHT_BLOCK)
    )
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = _pow2_ceil_scale(amax, FP8_MAX)
    tile_scale = scale.repeat_interleave(WEIGHT_BLOCK, 0)[:n].repeat_interleave(WEIGHT_BLOCK, 1)[:, :k]
    return to_e4m3(w / tile_scale), scale.to(torch.float8_e8m0fnu)


def quantize_fp4_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> packed FP4 (int8 storage, [N, K/2]) and E8M0 scales per 32 inputs [N, K/32]."""
    packed, scale = fp4_quantize_rows(weight, WEIGHT_BLOCK, "e8m0")
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)
