"""Static decode for CUDA graphs: a DeepseekV41Cache fixed for one-token steps, every buffer at a fixed address
and size, host counters advanced after each replayed step."""

from __future__ import annotations

import torch


class StaticDecodeMixin:
    """The static mode of DeepseekV41Cache (`make_static` ... `end_static`)."""

    @property
    def is_static(self) -> bool:
        return self.static_columns is not None

    def make_static(self, columns: int) -> None:
        """Fix every buffer for one-token decode steps until the cache holds `columns` columns: each step then
        runs the same kernels on the same memory with the same shapes (what a CUDA graph replays). Pool reads span
        the pools' capacity, masked by each query's visible rows, so a step's cost no longer follows the context."""
        keep = self.text_config.engram_max_ngram_size - 1  # a step's n-grams read this many earlier columns
        if not self.is_initialized or self.columns < max(keep, 1):
            raise ValueError(f"make_static needs a prefilled cache of at least {max(keep, 1)} columns: run the "
                             "prompt through the model first.")
        if self.pending_replay or self.dspark:
            raise ValueError("make_static needs a cache without a pending replay and without DSpark rings "
                             "(run one forward after loading a saved cache; create the cache with dspark=False).")
        if columns <= self.columns:
            raise ValueError(f"make_static({columns}): the cache already holds {self.columns} columns.")
        for record in (self._history, self._real, self._tokens):
            record.reserve(columns)
        for pool in self.pools.values():
            pool.kv.ensure_capacity(columns // pool.ratio + 1)
            pool.keys.ensure_capacity(columns // pool.ratio + 1)
            if pool.ratio > 1 and pool.carry is None:
                raise ValueError("make_static needs every pool's carry: prefill at least one token.")
        self.chunk_max_length = self.max_length  # read back here, once: static steps advance it on the host
        self.static_columns = torch.full((1, 1), self.columns, dtype=torch.long, device=self.lengths.device)
        self.static_limit = columns

    def end_static(self) -> None:
        """Back to growing buffers (any forward is allowed again)."""
        self.static_columns = None

    def static_state(self) -> tuple[int, int | None, int]:
        """The host-side counters a static step advances (a graph replay does not run Python)."""
        return self.columns, self._max_length, self.chunk_max_length

    def set_static_state(self, state: tuple[int, int | None, int]) -> None:
        self.columns, self._max_length, self.chunk_max_length = state

    def advance_static_step(self) -> None:
        """What a static step's begin_chunk and commit do on the host, for a step replayed from a graph."""
        self.columns += 1
        self._max_length += 1
        self.chunk_max_length = self._max_length
