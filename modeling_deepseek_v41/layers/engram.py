"""Engram: hashed n-gram table rows gated into every residual stream before the block."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.engram_gate import engram_gate
from ..kernels.numerics import WEIGHT_BLOCK, fp8_dequantize_rows, weight_dtype
from .linear import DeepseekV41Linear


def looked_up_rows(rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Table rows as the Engram layer uses them: FP8 rows dequantized exactly (to bf16), dense rows as stored."""
    return rows if scales is None else fp8_dequantize_rows(rows, scales, torch.bfloat16)


@dataclass
class PendingRows:
    """Rows of one lookup being gathered (and copied to the compute device) in the background."""

    source: torch.Tensor  # the [B,S,n_layers,columns] row ids the prefetch was issued for (kept alive)
    slot: int
    result: Future  # -> (weight rows, scale rows or None, copy-done event or None)


def finish(rows: tuple[torch.Tensor, torch.Tensor | None, object | None]
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Make gathered rows safe to use on the current stream."""
    weight, scale, event = rows
    if event is not None:
        done, stream = event
        current = torch.cuda.current_stream(weight.device)
        current.wait_event(done)
        for tensor in (weight, scale):
            if tensor is not None:
                tensor.record_stream(current)  # allocated on the side stream, consumed on this one
    return weight, scale


class DeepseekV41EngramTable(nn.Module):
    """The FP8 n-gram table [rows, head_dim] with E8M0 scales per 32 columns; rows are dequantized on lookup."""

    def __init__(self, rows: int, head_dim: int, quantized: bool) -> None:
        super().__init__()
        self.quantized = quantized
        # set by a tensor-parallel plan: the global rows [start, end) held here and the sum over the ranks' lookups
        self.row_range: tuple[int, int] | None = None
        self.reduce_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        if quantized:
            self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(rows, head_dim // WEIGHT_BLOCK, dtype=torch.float8_e8m0fnu),
                                      requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=weight_dtype(torch.bfloat16)))
            self.register_parameter("scale", None)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if self.row_range is None:
            return looked_up_rows(self.weight[row_ids], self.scale[row_ids] if self.quantized else None)
        start, end = self.row_range  # rows held elsewhere look up row 0 here, then count as zeros
        local = row_ids - start
        owned = (local >= 0) & (local < end - start)
        local = torch.where(owned, local, 0)
        rows = looked_up_rows(self.weight[local], self.scale[local] if self.quantized else None)
        return self.reduce_rows(torch.where(owned.unsqueeze(-1), rows, torch.zeros_like(rows)))

    @torch.no_grad()
    def dequantize_(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if not self.quantized:
            return
        dense = fp8_dequantize_rows(self.weight, self.scale, dtype)
        del self.weight, self.scale
        self.weight = nn.Parameter(dense)
        self.register_parameter("scale", None)
        self.quantized = False


class DeepseekV41ExternalEngramTable(nn.Module):
    """An Engram table kept off the compute device (`engram_storage="host"` or `"mmap"`): it holds no parameters;
    `from_pretrained` attaches the checkpoint's table (`ExternalTable`) after loading the rest. Only looked-up rows
    reach the compute device, and the forward usually finds them already gathered (the Engram hasher's
    `prefetch`, `engram_hashing.py`)."""

    def __init__(self, rows: int, head_dim: int, quantized: bool, storage: str) -> None:
        super().__init__()
        self.rows, self.head_dim, self.quantized, self.storage = rows, head_dim, quantized, storage
        self.external = None  # an engram_storage.ExternalTable once attached
        self.pending = None  # a PendingRows started before the layers ran
        self.prefetch_hits = 0  # lookups served by the early gather (inspection, tests)

    def checkpoint_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What the checkpoint stores for this table: its weight (and E8M0 scales when FP8), as a device table
        holds them."""
        if not self.quantized:
            return {"weight": ((self.rows, self.head_dim), weight_dtype(torch.bfloat16))}
        return {"weight": ((self.rows, self.head_dim), torch.float8_e4m3fn),
                "scale": ((self.rows, self.head_dim // WEIGHT_BLOCK), torch.float8_e8m0fnu)}

    def attach(self, external) -> None:
        if tuple(external.weight.shape) != (self.rows, self.head_dim):
            raise ValueError(f"Engram table of shape {list(external.weight.shape)} does not match the config's "
                             f"[{self.rows}, {self.head_dim}].")
        self.external = external

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if self.external is None:
            raise RuntimeError(
                f"This Engram table is stored off the device (engram_storage={self.storage!r}) and has not been "
                "attached: load the model with from_pretrained(..., engram_storage=...) from a checkpoint folder."
            )
        pending, self.pending = self.pending, None
        if pending is not None and _is_slot_view(row_ids, pending.source, pending.slot):
            self.prefetch_hits += 1
            weight, scale = finish(pending.result.result())
            weight = weight.to(row_ids.device)
            scale = None if scale is None else scale.to(row_ids.device)
        else:
            weight, scale = finish(self.external.gather(row_ids, row_ids.device))
        return looked_up_rows(weight, scale if self.quantized else None)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, head_dim={self.head_dim}, storage={self.storage}"


def _is_slot_view(row_ids: torch.Tensor, source: torch.Tensor, slot: int) -> bool:
    """Whether `row_ids` is exactly `source[:, :, slot]` (the same memory, so the same ids)."""
    view = source[:, :, slot]
    return (row_ids.device == view.device and row_ids.data_ptr() == view.data_ptr()
            and row_ids.shape == view.shape and row_ids.stride() == view.stride())


class DeepseekV41Engram(nn.Module):
    """out_c = h_c + gate_c * value, with one key per stream and a shared value projected from the looked-up rows.

    gate_c = sigmoid(signed_sqrt(<h_c, q_w k_w key_c> / (rms(h_c) rms(key_c) sqrt(D)))); dead positions get 0.
    """

    def __init__(self, config, rows: int, quantized: bool) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_mult = config.hc_mult
        self.eps = config.rms_norm_eps
        n_columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        storage = getattr(config, "engram_storage", "device")
        if storage == "device":
            self.embed = DeepseekV41EngramTable(rows, config.engram_head_dim, quantized)
        else:
            self.embed = DeepseekV41ExternalEngramTable(rows, config.engram_head_dim, quantized, storage)
        self.wkv = DeepseekV41Linear(n_columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1),
                                     storage="fp8" if quantized else "dense")
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=weight_dtype(torch.bfloat16)))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size, dtype=weight_dtype(torch.bfloat16)))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """streams [B,S,hc,D]; row_ids [B,S,columns]; live [B,S] bool (False: image span or padding)."""
        rows = self.embed(row_ids).to(streams.dtype).flatten(-2)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        return engram_gate(streams, key, value, self.q_weight, self.k_weight, self.eps, live)
