"""Decode steps replayed from CUDA graphs: a decode step of this model is launch-bound (thousands of small
kernels), so recording it once and replaying it removes the host's per-kernel cost."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from ...cache.cache import DeepseekV41Cache
from ...cache.parts import allocated_bytes
from ...layers.engram import DeepseekV41ExternalEngramTable


def check_graph_decoding(model) -> None:
    """Raise, naming the fix, when `model` cannot decode from a CUDA graph."""
    if model.device.type != "cuda":
        raise ValueError(f"CUDA graph decoding needs the model on a CUDA device; it is on {model.device}.")
    if model.training:
        raise ValueError("CUDA graph decoding is for inference: call model.eval() first.")
    if any(isinstance(m, DeepseekV41ExternalEngramTable) for m in model.modules()):
        raise ValueError("CUDA graph decoding needs the Engram tables on the GPU (engram_storage='device'): "
                         "host and mmap tables are read on the host in every step.")


class Recording(NamedTuple):
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the buffer the graph reads its input from
    outputs: Any  # the tensors the graph writes, overwritten by every replay
    columns: int  # the columns one call appends to the cache (host counters a replay advances)


class DeepseekV41CUDAGraphDecoder:
    """Runs `model(ids, cache=cache)` steps of 1 to `widest` tokens per batch row (and other calls on the cache,
    e.g. DSpark drafts, through `call`) from CUDA graphs.

    The cache is made static for `max_new_tokens` more columns: every buffer keeps its address and every shape its
    size, and host-side counters advance after each replay. Each kind of call runs eagerly the first time (that
    compiles the Triton kernels for its shapes), is recorded the second time and replayed from then on. The
    recordings can serve a later cache of the same rows and capacity (`detach`, then `attach`).

        cache = DeepseekV41Cache(model.config)
        logits = model(prompt_ids, cache=cache).logits
        decoder = DeepseekV41CUDAGraphDecoder(model, cache, max_new_tokens=256)
        for _ in range(256):
            next_ids = logits[:, -1:].argmax(-1)
            logits = decoder.step(next_ids)
        decoder.close()  # the cache accepts any forward again
    """

    def __init__(self, model, cache: DeepseekV41Cache, max_new_tokens: int, widest: int = 1) -> None:
        check_graph_decoding(model)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        if not 1 <= widest <= cache.crop_horizon + 1:
            raise ValueError(f"widest must be 1 to crop_horizon + 1 ({cache.crop_horizon + 1}), got {widest}.")
        limit = model.config.text_config.max_position_embeddings
        if cache.columns + max_new_tokens > limit:
            raise ValueError(f"{cache.columns} cached + {max_new_tokens} new tokens exceed max_position_embeddings "
                             f"({limit}).")
        self.capacity = cache.columns + max_new_tokens
        cache.make_static(self.capacity)
        self.model, self.cache, self.widest = model, cache, widest
        self.rows = cache.lengths.shape[0]
        self.parts = cache.static_parts()  # the buffers every recording reads and writes
        self.recordings: dict[Hashable, Recording] = {}
        self.seen: set[Hashable] = set()
        self.pool = None  # one memory pool for all recordings: they never run at the same time
        self.recorded_bytes = 0
        self.recorded = 0  # recordings made, ever

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed input_ids [B, w] (1 <= w <= widest); returns this step's logits [B, w, vocab] (a new tensor)."""
        if self.cache is None:
            raise ValueError("This decoder holds no cache (detached or closed): attach(cache) it to one first.")
        rows, width = input_ids.shape
        if rows != self.rows or not 1 <= width <= self.widest:
            raise ValueError(f"input_ids must have {self.rows} rows of 1 to {self.widest} tokens, got "
                             f"{tuple(input_ids.shape)}.")
        if self.cache.columns + width > self.capacity:
            raise ValueError(f"This decoder has room for {self.capacity - self.cache.columns} more tokens, not "
                             f"{width}; create a new one to go on.")
        model, cache = self.model, self.cache
        logits = self.call(("step", width), lambda ids: model(ids, cache=cache).logits, input_ids, columns=width)
        return logits.clone()

    @torch.no_grad()
    def call(self, key: Hashable, fn: Callable[[torch.Tensor], Any], inputs: torch.Tensor, columns: int = 0) -> Any:
        """fn(inputs) on the static cache: eager the first time `key` comes, recorded the second, replayed after.
        `columns`: what one call appends to the cache. Replays return the recording's own output tensors."""
        if self.cache is None:
            raise ValueError("This decoder holds no cache (detached or closed): attach(cache) it to one first.")
        recording = self.recordings.get(key)
        if recording is None:
            if key not in self.seen:
                self.seen.add(key)
                return fn(inputs.to(self.model.device))
            recording = self.recordings[key] = self._record(fn, inputs, columns)
            self.recorded += 1
        recording.inputs.copy_(inputs)
        recording.graph.replay()
        if recording.columns:
            self.cache.log.advance_step(recording.columns)
        return recording.outputs

    def _record(self, fn: Callable, inputs: torch.Tensor, columns: int) -> Recording:
        """Record one call; recording runs no kernel, so the host counters it advanced are put back."""
        buffer = inputs.to(self.model.device).clone()
        state = self.cache.log.host_state()
        reserved = torch.cuda.memory_reserved(buffer.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn(buffer)
        finally:
            self.cache.log.set_host_state(state)
        self.pool = graph.pool()
        self.recorded_bytes += max(torch.cuda.memory_reserved(buffer.device) - reserved, 0)
        return Recording(graph, buffer, outputs, columns)

    def nbytes(self) -> int:
        """Device memory this decoder holds: the static cache buffers and what its recordings reserved."""
        return allocated_bytes(self.parts) + self.recorded_bytes

    def attach(self, cache: DeepseekV41Cache) -> bool:
        """Replay this decoder's recordings on `cache` (of the same rows and layers, with room in this capacity):
        the cache is made static and moves its state into the buffers they use. False, with the cache as it
        was, when it does not fit."""
        if self.cache is not None:
            raise ValueError("This decoder is attached to a cache: detach() it first.")
        if not cache.is_initialized or cache.lengths.shape[0] != self.rows or cache.columns >= self.capacity:
            return False
        cache.make_static(self.capacity)
        if not cache.adopt_static_parts(self.parts):
            cache.end_static()
            return False
        self.cache = cache
        return True

    def detach(self) -> None:
        """The cache gets copies of its state in growing buffers; the recordings keep theirs for `attach`."""
        if self.cache is not None:
            self.cache.own_parts()
            self.cache.end_static()
            self.cache = None

    def close(self) -> None:
        """Release the recordings and give the cache back its growing buffers."""
        if self.cache is not None:
            self.cache.end_static()
        self.cache, self.recordings, self.parts, self.pool = None, {}, None, None
