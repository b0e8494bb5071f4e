"""Row-chunked producers for the converters: copy/cast, exact dequantization and (re)quantization.

Each producer reads a bounded number of rows at a time (a multiple of 32, so FP8 32x32 tiles never straddle two
chunks) and yields `(name, first_row, rows)` pieces for `ShardWriter`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from modeling_deepseek_v41.kernels.numerics import (
    WEIGHT_BLOCK, dequantize_fp4_weight, dequantize_fp8_weight, e2m1_codes, e2m1_values, fp8_dequantize_rows,
    fp8_quantize_rows, pack_nibbles, quantize_fp4_weight, quantize_fp8_weight, to_e4m3, unpack_nibbles,
)
from modeling_deepseek_v41.loading.safetensors_file import SafetensorsEntry

from .layout import KIND_FP4, KIND_FP8_TILE
from .streaming import Piece, check_finite

DEFAULT_CHUNK_BYTES = 16 * 2**20  # fp32 bytes of one chunk of dense rows


def row_chunks(rows: int, row_values: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of about `chunk_bytes` of fp32 each, starting on multiples of 32."""
    per_chunk = max(WEIGHT_BLOCK, (chunk_bytes // max(1, 4 * row_values)) // WEIGHT_BLOCK * WEIGHT_BLOCK)
    for start in range(0, max(rows, 1), per_chunk):
        yield start, min(rows, start + per_chunk)


def _dense_row_values(source: SafetensorsEntry, kind: str | None) -> int:
    columns = math.prod(source.shape[1:])
    return columns * 2 if kind == KIND_FP4 else columns


def copy_cast(source: SafetensorsEntry, name: str, dtype: torch.dtype, chunk_bytes: int = DEFAULT_CHUNK_BYTES
              ) -> Iterator[Piece]:
    """The tensor as stored, cast to `dtype` (exact for bf16 <-> fp32 of bf16 values; bytes kept otherwise)."""
    for start, stop in row_chunks(source.rows, _dense_row_values(source, None), chunk_bytes):
        piece = source.read_rows(start, stop) if source.shape else source.read_rows()
        yield name, start, piece if piece.dtype == dtype else piece.to(dtype)


def dequantize(kind: str, weight: SafetensorsEntry, scale: SafetensorsEntry, name: str, dtype: torch.dtype,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Piece]:
    """The exact dense value of an FP8 (32x32 tiles or per-row-32) or packed FP4 weight, in `dtype`."""
    for start, stop in row_chunks(weight.rows, _dense_row_values(weight, kind), chunk_bytes):
        values = weight.read_rows(start, stop)
        if kind == KIND_FP8_TILE:
            scales = scale.read_rows(start // WEIGHT_BLOCK, -(-stop // WEIGHT_BLOCK))
            yield name, start, dequantize_fp8_weight(values, scales, dtype)
        elif kind == KIND_FP4:
            yield name, start, dequantize_fp4_weight(values, scale.read_rows(start, stop), dtype)
        else:
            yield name, start, fp8_dequantize_rows(values, scale.read_rows(start, stop), dtype)


def _tile_view(x: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [tn, 32, tk, 32], zero-padded to whole tiles."""
    n, k = x.shape
    padded = torch.nn.functional.pad(x, (0, -k % WEIGHT_BLOCK, 0, -n % WEIGHT_BLOCK))
    return padded.unflatten(0, (-1, WEIGHT_BLOCK)).unflatten(-1, (-1, WEIGHT_BLOCK))


def _expand_tiles(tile_values: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return tile_values.repeat_interleave(WEIGHT_BLOCK, 0)[:n].repeat_interleave(WEIGHT_BLOCK, 1)[:, :k]


def _quantize_fp8_tiles(dense: torch.Tensor, prior: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if prior is None:
        return quantize_fp8_weight(dense)
    n, k = dense.shape
    exact = dense.float()
    prior_full = _expand_tiles(prior.float(), n, k)
    candidate = to_e4m3(exact / prior_full)
    matches = (candidate.float() * prior_full == exact)
    if bool(matches.all()):  # the usual case for an unmodified checkpoint: no fresh scales needed
        return candidate, prior
    tile_ok = _tile_view(torch.where(matches, 0, 1)).amax(dim=(1, 3)) == 0
    values, scales = quantize_fp8_weight(dense)
    scales = torch.where(tile_ok, prior.float(), scales.float()).to(torch.float8_e8m0fnu)
    values = torch.where(_expand_tiles(tile_ok, n, k), candidate, values)
    return values, scales


def _quantize_groups(dense: torch.Tensor, prior: torch.Tensor | None, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, 32 values) groups: packed FP4 (int8) or FP8 rows, with E8M0 scales [N, K/32]."""
    quantize_fresh = quantize_fp4_weight if fp4 else fp8_quantize_rows
    if prior is None:
        return quantize_fresh(dense)
    groups = dense.float().unflatten(-1, (-1, WEIGHT_BLOCK))
    prior_full = prior.float().unsqueeze(-1)
    if fp4:
        candidate = e2m1_codes((groups / prior_full).clamp(-6.0, 6.0))
        matches = e2m1_values(candidate) * prior_full == groups
    else:
        candidate = to_e4m3(groups / prior_full)
        matches = candidate.float() * prior_full == groups
    group_ok = matches.all(dim=-1)
    if bool(group_ok.all()):  # the usual case for an unmodified checkpoint: no fresh scales needed
        chosen = candidate.flatten(-2)
        return (pack_nibbles(chosen).view(torch.int8) if fp4 else chosen), prior
    values, scales = quantize_fresh(dense)
    fresh = (unpack_nibbles(values) if fp4 else values).unflatten(-1, (-1, WEIGHT_BLOCK))
    chosen = torch.where(group_ok.unsqueeze(-1), candidate, fresh).flatten(-2)
    scales = torch.where(group_ok, prior.float(), scales.float()).to(torch.float8_e8m0fnu)
    return (pack_nibbles(chosen).view(torch.int8) if fp4 else chosen), scales


def quantize(kind: str, dense: SafetensorsEntry, weight_name: str, scale_name: str, prior: SafetensorsEntry | None = None,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_non_finite: bool = False) -> Iterator[Piece]:
    """Quantize a dense weight to the hub's storage (the numerics module's rules), yielding weight and scale pieces.

    With `prior` (the scales the hub checkpoint had), every tile or group that those scales represent exactly keeps
    them, so a dequantized checkpoint goes back to the very same bytes; other tiles get fresh power-of-two scales.
    NaN/Inf in the dense weight are refused (naming it) unless `keep_non_finite`: FP8 saturates Inf silently.
    """
    for start, stop in row_chunks(dense.rows, _dense_row_values(dense, None), chunk_bytes):
        rows = dense.read_rows(start, stop)
        if not keep_non_finite:
            check_finite(weight_name, start, rows)
        if kind == KIND_FP8_TILE:
            scale_start = start // WEIGHT_BLOCK
            old = prior.read_rows(scale_start, -(-stop // WEIGHT_BLOCK)) if prior is not None else None
            values, scales = _quantize_fp8_tiles(rows, old)
        else:
            scale_start = start
            old = prior.read_rows(start, stop) if prior is not None else None
            values, scales = _quantize_groups(rows, old, fp4=kind == KIND_FP4)
        yield weight_name, start, values
        yield scale_name, scale_start, scales
