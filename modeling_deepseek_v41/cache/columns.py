"""What a cache consumed, column by column: every input column's compressed id (the Engram history), whether it
is a real token, and its raw id, with the column and per-row token counts. Growing buffers, or fixed ones written
at a column counter held on the device (static decode)."""

from __future__ import annotations

import torch


def with_capacity(buffer: torch.Tensor, size: int) -> torch.Tensor:
    """`buffer` [B, n, ...] with `size` entries along dim 1: its first min(n, size) kept, the rest zero."""
    resized = buffer.new_zeros(buffer.shape[0], size, *buffer.shape[2:])
    kept = min(size, buffer.shape[1])
    resized[:, :kept] = buffer[:, :kept]
    return resized


class Columns:
    """A [B, columns] record that grows by doubling its capacity (no per-step copy of the whole history)."""

    def __init__(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(batch, 16, dtype=dtype, device=device)

    def write(self, start: int, values: torch.Tensor) -> None:
        end = start + values.shape[1]
        if end > self.buffer.shape[1]:
            self.buffer = with_capacity(self.buffer, max(end, 2 * self.buffer.shape[1]))
        self.buffer[:, start:end] = values

    def write_at(self, column: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [B, n] from a column held on the device on (a static step): no host int involved."""
        index = column + torch.arange(values.shape[1], device=column.device)
        self.buffer.scatter_(1, index.expand(self.buffer.shape[0], -1), values.to(self.buffer.dtype))

    def reserve(self, columns: int) -> None:
        """Exactly `columns` columns of capacity (equal capacities, equal shapes); the caller holds none past them."""
        if columns != self.buffer.shape[1]:
            self.buffer = with_capacity(self.buffer, columns)

    def view(self, start: int, end: int) -> torch.Tensor:
        return self.buffer[:, start:end]

    def select(self, index: torch.Tensor) -> None:
        self.buffer = self.buffer.index_select(0, index)


class ColumnLog:
    """Every input column a cache consumed (its compressed id, DEAD at images and padding; whether it is a real
    token; its raw id), the column count and each row's real tokens, whose most is also kept on the host. While
    `fix`ed (static decode), steps write their columns from `cursor`, the column count on the device, and advance
    (or a crop steps back) it and the row counts in place, so that a replayed CUDA graph uses the same buffers."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.history = Columns(batch, torch.long, device)
        self.real = Columns(batch, torch.bool, device)
        self.tokens = Columns(batch, torch.long, device)
        self.columns = 0
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B] real tokens per row
        self.cursor: torch.Tensor | None = None  # [1, 1] the column count on the device while fixed
        self.limit = 0  # the columns a fixed log has room for
        self.fixed_from = 0  # the column count when it was fixed

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self._lengths = value
        self._max_length = None  # read back from the tensor only if asked before the next append sets it

    @property
    def max_length(self) -> int:
        """The most real tokens any row holds, as a Python int (decode steps know it without a device read)."""
        if self._max_length is None:
            self._max_length = int(self._lengths.amax()) if self._lengths.numel() else 0
        return self._max_length

    def fix(self, capacity: int) -> None:
        """Reserve `capacity` columns and write the next ones at a column counter on the device."""
        for record in (self.history, self.real, self.tokens):
            record.reserve(capacity)
        self.limit = capacity
        self.fixed_from = self.columns  # a crop goes back this far at most: before it, padding may be cropped
        self.cursor = torch.full((1, 1), self.columns, dtype=torch.long, device=self.tokens.buffer.device)
        self._max_length = self.max_length  # read back here, once: static steps advance it on the host

    def unfix(self) -> None:
        self.cursor = None

    def append_history(self, compressed: torch.Tensor, replayed: int, keep: int) -> torch.Tensor:
        """Record the chunk's compressed ids (the first `replayed` are there already); returns the last `keep`
        earlier columns followed by the whole chunk."""
        if self.cursor is not None:  # the step's columns start at the device counter; the window ends with them
            self.history.write_at(self.cursor, compressed)
            window = self.cursor - keep + torch.arange(keep + compressed.shape[1], device=compressed.device)
            return self.history.buffer.index_select(1, window.view(-1))
        self.history.write(self.columns, compressed[:, replayed:])
        new_end = self.columns + compressed.shape[1] - replayed
        return self.history.view(max(0, self.columns - replayed - keep), new_end)

    def append(self, ids: torch.Tensor, real: torch.Tensor, max_length: int) -> None:
        """Account new columns: their raw ids [B, n] and real-token flags, and the most real tokens a row then
        holds (known on the host)."""
        if self.cursor is not None:
            self.tokens.write_at(self.cursor, ids)
            self.real.write_at(self.cursor, real)
            self.cursor.add_(ids.shape[1])
            self._lengths.add_(real.sum(dim=1))
        else:
            self.tokens.write(self.columns, ids)
            self.real.write(self.columns, real)
            self.lengths = self.lengths + real.sum(dim=1)
        self.columns += real.shape[1]
        self._max_length = max_length

    def host_state(self) -> tuple[int, int | None]:
        """The host-side counters a static step advances (a graph replay does not run Python)."""
        return self.columns, self._max_length

    def set_host_state(self, state: tuple[int, int | None]) -> None:
        self.columns, self._max_length = state

    def advance_step(self, columns: int = 1) -> None:
        """What a static step's append of `columns` columns does on the host, for a step replayed from a graph."""
        self.columns += columns
        self._max_length += columns

    def crop(self, count: int) -> None:
        """Forget the last `count` columns. A fixed log steps its counters back in place, and its host maximum by
        `count` (every column of a static step is a real token of every row)."""
        removed = self.real.view(self.columns - count, self.columns).sum(dim=1)
        if self.cursor is not None:
            self._lengths.sub_(removed)
            self.cursor.sub_(count)
            self._max_length -= count
        else:
            self.lengths = self.lengths - removed
        self.columns -= count

    def replay(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and positions [B, count] of the last `count` columns (-1 at padding): what a restored cache runs
        again to rebuild its windows."""
        real = self.real.view(0, self.columns)
        positions = torch.where(real, real.long().cumsum(-1) - 1, -1)[:, self.columns - count:]
        return self.tokens.view(self.columns - count, self.columns), positions

    def is_prefix_of(self, input_ids: torch.Tensor) -> bool:
        """Whether every row of `input_ids` [B, S] starts with this log's token ids."""
        logged = self.tokens.view(0, self.columns)
        return input_ids.shape[1] >= self.columns and torch.equal(input_ids[:, : self.columns].to(logged.device),
                                                                  logged)

    def saved(self) -> dict[str, torch.Tensor]:
        """What a saved prefix keeps per column and row: token ids (int32), real-token flags (uint8), lengths."""
        return {"tokens": self.tokens.view(0, self.columns).to(torch.int32).contiguous(),
                "real": self.real.view(0, self.columns).to(torch.uint8).contiguous(),
                "lengths": self.lengths.contiguous()}

    def restore(self, tokens: torch.Tensor, real: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor
                ) -> None:
        """Fill this (new) log with a saved prefix's columns."""
        self.tokens.write(0, tokens)
        self.history.write(0, history)
        self.real.write(0, real)
        self.columns = tokens.shape[1]
        self.lengths = lengths

    def select(self, indices: torch.Tensor) -> None:
        self.lengths = self.lengths.index_select(0, indices)
        for record in (self.history, self.real, self.tokens):
            record.select(indices)

    def history_bytes(self) -> int:
        """Bytes of the Engram history: the compressed id and the real flag of each column."""
        return self.columns * self.history.buffer.shape[0] * (self.history.buffer.element_size() + 1)
