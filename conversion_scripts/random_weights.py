"""Seeded random tensors in the hub's storage formats, with statistics close to the released checkpoint's.

The recipe follows the reference fixtures (fixtures/reference/*/meta.json, "weight_statistics"): projections
N(0, 1) * fan_in^-0.5 * a per-name gain, norms near the released means, embeddings N(0, 0.12^2), Engram tables
N(0, 0.15^2), small 1-D fp32 mixing parameters. Every tensor has its own generator seeded from (seed, name), so
the values do not depend on the order tensors are drawn in or on the sharding.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

from modeling_deepseek_v41.kernels.numerics import WEIGHT_BLOCK, fp8_quantize_rows, pack_nibbles, quantize_fp8_weight

from .layout import KIND_FP4, KIND_FP8_ROWS, KIND_FP8_TILE

_GAINS = (("wq_a", 1.6), ("wq_b", 0.95), ("attn.wkv", 1.8), ("wo_a", 1.6), ("wo_b", 1.9), ("ffn.gate", 2.9),
          ("w1", 1.5), ("w3", 1.5), ("w2", 1.05))
_NORM_MEANS = (("attn_norm", 0.025), ("ffn_norm", 0.2), ("q_norm", 0.97), ("kv_norm", 0.4),
               ("compressor.norm", 0.6), ("k_norm", 0.5))
_FP32_MIXING = re.compile(r"(hc_(attn|ffn)_(base|scale)|attn_sink|gate\.bias(_vl)?)$")
_EMBEDDINGS = re.compile(r"(^|\.)embed\.weight$|^image_(start|end|newline)$")
EMBED_STD = 0.12
E2M1_UNIFORM_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)
ENGRAM_STD = 0.15


def generator_for(seed: int, name: str) -> torch.Generator:
    """A generator that depends only on the seed and the tensor's name."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _gain(name: str) -> float:
    module = name.rsplit(".", 1)[0]
    if module.startswith(("vision.", "aligner.")):
        return 0.2 if module == "aligner.w2" else 1.0
    for key, gain in _GAINS:
        if module.endswith(key) and not module.endswith("indexer.wq_b"):
            return gain
    return 1.0


def _norm_mean(name: str) -> float:
    module = name.rsplit(".", 1)[0]
    for key, mean in _NORM_MEANS:
        if module.endswith(key):
            return mean
    return 1.0


def dense_value(name: str, shape: tuple[int, ...], generator: torch.Generator, index_head_dim: int = 0
                ) -> torch.Tensor:
    """fp32 values for one tensor (before any quantization or storage cast)."""
    noise = torch.randn(shape, generator=generator)
    leaf = name.rsplit(".", 1)[-1]
    if "engram.embed" in name:
        return noise * ENGRAM_STD
    if _EMBEDDINGS.search(name):
        return noise * EMBED_STD
    if leaf in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * noise
    if _FP32_MIXING.search(name):
        return 0.5 * noise
    if leaf == "bias":
        return 0.02 * noise
    if len(shape) == 1 and leaf == "weight":  # every remaining 1-D weight is a norm
        return _norm_mean(name) * (1.0 + 0.1 * noise)
    fan_in = shape[-1] if len(shape) > 1 else 1
    value = noise * fan_in**-0.5 * _gain(name)
    if name.endswith("indexer.wq_b.weight") and index_head_dim:
        # sign-opposed query head pairs keep index scores away from exact-zero ties (as in the reference fixtures)
        paired = (shape[0] // (2 * index_head_dim)) * 2 * index_head_dim
        heads = value[:paired].unflatten(0, (-1, 2, index_head_dim))
        heads[:, 1] = -heads[:, 0]
    return value


def random_fp4(name: str, packed_shape: tuple[int, ...], generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random e2m1 codes with one power-of-two scale per tensor, chosen so the weight's RMS is about
    fan_in^-0.5 * gain (drawing codes directly is much faster than quantizing Gaussian values)."""
    rows, fan_in = packed_shape[0], packed_shape[1] * 2
    codes = torch.randint(0, 16, (rows, fan_in), generator=generator, dtype=torch.uint8)
    target_rms = fan_in**-0.5 * _gain(name)
    scale = 2.0 ** round(math.log2(target_rms / E2M1_UNIFORM_RMS))
    scales = torch.full((rows, fan_in // WEIGHT_BLOCK), scale).to(torch.float8_e8m0fnu)
    return pack_nibbles(codes).view(torch.int8), scales


def random_tensors(name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str | None, seed: int,
                   scale_name: str | None = None, index_head_dim: int = 0) -> dict[str, torch.Tensor]:
    """The stored tensor(s) for `name`: a quantized weight with its scale, or one tensor cast to `dtype`.

    For FP4 weights `shape` is the packed [out, in/2] shape."""
    generator = generator_for(seed, name)
    if kind == KIND_FP4:
        weight, scale = random_fp4(name, shape, generator)
    elif kind == KIND_FP8_TILE:
        weight, scale = quantize_fp8_weight(dense_value(name, shape, generator, index_head_dim))
    elif kind == KIND_FP8_ROWS:
        weight, scale = fp8_quantize_rows(dense_value(name, shape, generator))
    else:
        return {name: dense_value(name, shape, generator, index_head_dim).to(dtype)}
    return {name: weight, scale_name: scale}
