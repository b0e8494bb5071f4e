"""Growable per-batch-row storage of packed KV rows: FP4 pool rows and FP8 window rings.

Values are stored as the packed bytes plus scales and unpacked only when read (after gathering the rows needed).
"""

from __future__ import annotations

import copy

import torch

from ..kernels.fp4_rows import fp4_quantize_rows
from ..kernels.numerics import (
    INDEX_BLOCK,
    POOL_KV_BLOCK,
    WEIGHT_BLOCK,
    e8m0_bytes,
    fp4_dequantize_rows,
    fp8_dequantize_rows,
    fp8_quantize_rows,
)
from .columns import with_capacity


def latest_positions(positions: torch.Tensor, count: int) -> torch.Tensor:
    """Which of a chunk's positions [B,S] a store of `count` slots by position modulo count keeps: each row's last
    `count` (padding, -1, never), so no two kept positions share a slot (a device's scatter of several writers to
    one slot picks any of them)."""
    end = torch.where(positions >= 0, positions, -1).amax(dim=1, keepdim=True)
    return (positions >= 0) & (positions > end - count)


def scatter_rows_where(store: torch.Tensor, index: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
    """store[b, index[b, g]] = values[b, g] where keep [B, G], with nothing read back to the host (a boolean mask
    index would read its count): every other entry writes the row of its batch row's first kept entry with that
    entry's values (row 0 with the values already there when the row keeps none), so all writers of a row write
    the same values, whatever order a device's scatter takes. The kept entries' rows must be distinct per row."""
    first = keep.to(torch.int32).argmax(dim=1, keepdim=True)  # the first kept entry (0 when there is none)
    any_kept = keep.any(dim=1, keepdim=True)
    spare_row = torch.where(any_kept, index.gather(1, first), 0)
    width = store.shape[-1]
    spare = torch.where(any_kept.unsqueeze(-1), values.gather(1, first.unsqueeze(-1).expand(-1, 1, width)),
                        store[:, :1])
    target = torch.where(keep, index, spare_row).unsqueeze(-1).expand(-1, -1, width)
    store.scatter_(1, target, torch.where(keep.unsqueeze(-1), values, spare))


class PackedRows:
    """Rows [B, capacity, dim] kept as (codes, scales) in one of three formats.

    - "fp4_e4m3": E2M1 nibbles with an E4M3 scale per 16 values (compressed KV: 288 bytes per 512-wide row)
    - "fp4_e8m0": E2M1 nibbles with an E8M0 scale per 32 values (index keys: 68 bytes per 128-wide row)
    - "fp8_e8m0": e4m3 bytes with an E8M0 scale per 32 values (window KV: 528 bytes per 512-wide row)
    FP4 rows are written as the exact codes and scales of their QDQ step; FP8 rows are re-encoded from their QDQ'd
    values, which reproduces the same values (a power-of-two re-scaling of an e4m3 grid is exact).
    """

    def __init__(self, fmt: str, batch: int, dim: int, capacity: int, device: torch.device) -> None:
        self.fmt = fmt
        self.dim = dim
        # bytes are kept as uint8 (indexed writes are not implemented for the float8 dtypes) and viewed on read
        if fmt == "fp8_e8m0":
            self.code_dtype, self.scale_dtype, code_width, block = (torch.float8_e4m3fn, torch.float8_e8m0fnu, dim,
                                                                    WEIGHT_BLOCK)
        else:
            code_width, block = dim // 2, (POOL_KV_BLOCK if fmt == "fp4_e4m3" else INDEX_BLOCK)
            self.code_dtype = torch.uint8
            self.scale_dtype = torch.float8_e4m3fn if fmt == "fp4_e4m3" else torch.float8_e8m0fnu
        self.codes = torch.zeros(batch, capacity, code_width, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(batch, capacity, dim // block, dtype=torch.uint8, device=device)

    @property
    def capacity(self) -> int:
        return self.codes.shape[1]

    @property
    def bytes_per_row(self) -> int:
        return (self.codes[0, 0].nbytes + self.scales[0, 0].nbytes) if self.capacity else 0

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def ensure_capacity(self, rows: int) -> None:
        if rows > self.capacity:
            self.resize(max(rows, 2 * self.capacity))

    def resize(self, rows: int) -> None:
        """Exactly `rows` rows of capacity (a fixed pool's, so that equal capacities mean equal shapes): new rows
        are zero, rows past `rows` are dropped (the caller holds none there)."""
        if rows != self.capacity:
            self.codes, self.scales = with_capacity(self.codes, rows), with_capacity(self.scales, rows)

    def _encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fmt == "fp8_e8m0":
            return fp8_quantize_rows(values)
        block, scale_format = (POOL_KV_BLOCK, "e4m3") if self.fmt == "fp4_e4m3" else (INDEX_BLOCK, "e8m0")
        return fp4_quantize_rows(values, block, scale_format)

    def _scale_bytes(self, scales: torch.Tensor) -> torch.Tensor:
        if self.scale_dtype == torch.float8_e8m0fnu:  # by integer ops: Inductor cannot bitcast E8M0
            return e8m0_bytes(scales)
        return scales.to(self.scale_dtype).view(torch.uint8)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = codes.view(self.code_dtype)
        if self.scale_dtype != torch.float8_e8m0fnu:  # E8M0 scales stay bytes (decoded by e8m0_to_float)
            scales = scales.view(self.scale_dtype)
        if self.fmt == "fp8_e8m0":
            return fp8_dequantize_rows(codes, scales, dtype)
        return fp4_dequantize_rows(codes, scales, dtype)

    def write(self, batch_ids: torch.Tensor, row_ids: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [n, dim] at (batch_ids[n], row_ids[n])."""
        if values.numel() == 0:
            return
        codes, scales = self._encode(values)
        self.write_codes(batch_ids, row_ids, codes, scales)

    def write_codes(self, batch_ids: torch.Tensor, row_ids: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor) -> None:
        """Store already-encoded rows (the exact codes and scales of the QDQ step)."""
        if codes.numel() == 0:
            return
        self.codes[batch_ids, row_ids] = codes.to(self.code_dtype).view(torch.uint8)
        self.scales[batch_ids, row_ids] = self._scale_bytes(scales)

    def write_codes_where(self, row_ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                          keep: torch.Tensor) -> None:
        """Store encoded rows codes [B, G, w] at (b, row_ids[b, g]) where keep [B, G] (see scatter_rows_where)."""
        scatter_rows_where(self.codes, row_ids, codes.to(self.code_dtype).view(torch.uint8), keep)
        scatter_rows_where(self.scales, row_ids, self._scale_bytes(scales), keep)

    def write_codes_one_per_row(self, row_ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                                keep: torch.Tensor) -> None:
        """Store encoded rows codes [B, w] at (b, row_ids[b]) where keep [B], without reading anything back to
        the host: rows not kept rewrite the bytes already at row 0."""
        target = torch.where(keep, row_ids, 0).view(-1, 1, 1)
        for store, values in ((self.codes, codes.to(self.code_dtype)), (self.scales, self._scale_bytes(scales))):
            index = target.expand(-1, 1, store.shape[-1])
            kept = torch.where(keep.view(-1, 1, 1), values.view(torch.uint8).unsqueeze(1), store.gather(1, index))
            store.scatter_(1, index, kept)

    def write_one_per_row(self, row_ids: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
        """Encode values [B, dim] and store them as `write_codes_one_per_row` does."""
        codes, scales = self._encode(values)
        self.write_codes_one_per_row(row_ids, codes, scales, keep)

    def gather(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """row_ids [B, ...] (valid indices) -> values [B, ..., dim], unpacking only the gathered rows."""
        batch = row_ids.shape[0]
        flat = row_ids.reshape(batch, -1)
        batch_ids = torch.arange(batch, device=row_ids.device).unsqueeze(1).expand_as(flat)
        values = self._decode(self.codes[batch_ids, flat], self.scales[batch_ids, flat], dtype)
        return values.view(*row_ids.shape, self.dim)

    def read(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `rows` rows of every batch row, unpacked: [B, rows, dim]."""
        return self._decode(self.codes[:, :rows], self.scales[:, :rows], dtype)

    def clone(self) -> PackedRows:
        """An independent copy of the rows (same format and capacity)."""
        held = copy.copy(self)
        held.codes, held.scales = self.codes.clone(), self.scales.clone()
        return held

    def select_batch(self, index: torch.Tensor) -> None:
        self.codes = self.codes.index_select(0, index)
        self.scales = self.scales.index_select(0, index)
