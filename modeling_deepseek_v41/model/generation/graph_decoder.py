"""One-token decode steps replayed from a CUDA graph: a decode step of this model is launch-bound (thousands of
small kernels), so recording it once and replaying it removes the host's per-kernel cost."""

from __future__ import annotations

import torch

from ...cache.cache import DeepseekV41Cache
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


class DeepseekV41CUDAGraphDecoder:
    """Runs `model(next_ids, cache=cache)` one token per batch row at a time, from a CUDA graph.

    The cache is made static (`cache.make_static`) for `max_new_tokens` more tokens: every buffer keeps its
    address and every shape its size, and host-side counters advance after each replay. The first step runs
    eagerly (it compiles and builds what the step needs), the second records the graph, the rest replay it.

        cache = DeepseekV41Cache(model.config)
        logits = model(prompt_ids, cache=cache).logits
        decoder = DeepseekV41CUDAGraphDecoder(model, cache, max_new_tokens=256)
        for _ in range(256):
            next_ids = logits[:, -1:].argmax(-1)
            logits = decoder.step(next_ids)
        decoder.close()  # the cache accepts any forward again
    """

    def __init__(self, model, cache: DeepseekV41Cache, max_new_tokens: int) -> None:
        check_graph_decoding(model)
        device = model.device
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        limit = model.config.text_config.max_position_embeddings
        if cache.columns + max_new_tokens > limit:
            raise ValueError(f"{cache.columns} cached + {max_new_tokens} new tokens exceed max_position_embeddings "
                             f"({limit}).")
        cache.make_static(cache.columns + max_new_tokens)
        self.model, self.cache, self.max_new_tokens = model, cache, max_new_tokens
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.input_ids = torch.zeros(cache.lengths.shape[0], 1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, input_ids [B, 1]; returns this step's logits [B, 1, vocab] (a new tensor)."""
        if input_ids.shape != self.input_ids.shape:
            raise ValueError(f"input_ids must have shape {tuple(self.input_ids.shape)}, got {tuple(input_ids.shape)}.")
        if self.steps >= self.max_new_tokens:
            raise ValueError(f"This decoder was made for {self.max_new_tokens} steps; create a new one to go on.")
        self.steps += 1
        if self.steps == 1:  # eager: compiles the Triton kernels and builds the expert stacks before recording
            return self.model(input_ids.to(self.input_ids.device), cache=self.cache).logits
        self.input_ids.copy_(input_ids)
        if self.graph is None:
            self._record()
        self.graph.replay()
        self.cache.log.advance_step()
        return self.logits.clone()

    def _record(self) -> None:
        """Record one step; recording runs no kernel, so the host counters it advanced are put back."""
        state = self.cache.log.host_state()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self.model(self.input_ids, cache=self.cache).logits
        finally:
            self.cache.log.set_host_state(state)
        self.graph = graph

    def close(self) -> None:
        """Release the graph and give the cache back its growing buffers."""
        self.graph, self.logits = None, None
        self.cache.end_static()


class GenerationGraphs:
    """`generate(..., cuda_graphs=True)`: the one-token steps of one generate() call go through a
    DeepseekV41CUDAGraphDecoder, made after the prompt's forward with room for the rest of `max_length`."""

    def __init__(self, model, cache: DeepseekV41Cache, max_length: int) -> None:
        self.model, self.cache, self.max_length = model, cache, max_length
        self.decoder: DeepseekV41CUDAGraphDecoder | None = None
        self.running = False  # the decoder's own forward calls (its eager and recording steps) run the model

    def handles(self, cache, input_ids: torch.Tensor, pixel_values) -> bool:
        """A decode step of this generation (its attention mask's new column is always 1, so it is not needed)."""
        return (not self.running and cache is self.cache and input_ids.shape[1] == 1 and cache.columns > 0 and not cache.pending_replay
                and pixel_values is None)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            self.decoder = DeepseekV41CUDAGraphDecoder(self.model, self.cache, self.max_length - self.cache.columns)
        self.running = True
        try:
            return self.decoder.step(input_ids)
        finally:
            self.running = False

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
