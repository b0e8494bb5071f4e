"""What `generate(cuda_graphs=True)` replays: the decoders a model keeps between calls (`DeepseekV41DecodeGraphs`,
`model.decode_graphs`) and one call's use of them (`GenerationGraphs`: its decode and verify steps, its drafts)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from ...cache.cache import DeepseekV41Cache
from .dspark import Draft, draft_forward, dspark_draft
from .graph_decoder import DeepseekV41CUDAGraphDecoder

SMALLEST_CAPACITY = 256  # columns; capacities are rounded up to powers of two from here


def capacity_bucket(columns: int) -> int:
    """The static capacity for `columns` columns: the next power of two (at least SMALLEST_CAPACITY), so calls of
    similar lengths share recordings while a step's cost (it reads its whole capacity) stays within 2x."""
    return max(SMALLEST_CAPACITY, 1 << (columns - 1).bit_length())


class DeepseekV41DecodeGraphs:
    """The CUDA-graph decoders a model keeps between `generate(cuda_graphs=True)` calls, so that a later call of
    the same batch rows, capacity bucket and drafting width records nothing: its cache moves its state into the
    static buffers of the earlier recordings. At most `max_decoders` are kept (the least recently used goes first);
    `nbytes()` reports their device memory and `release()` frees it. Found as `model.decode_graphs`."""

    def __init__(self, max_decoders: int = 4) -> None:
        self.max_decoders = max_decoders
        self._decoders: OrderedDict[tuple, DeepseekV41CUDAGraphDecoder] = OrderedDict()

    def decoder_for(self, model, cache: DeepseekV41Cache, new_columns: int, widest: int
                    ) -> DeepseekV41CUDAGraphDecoder:
        """A decoder attached to `cache` with room for `new_columns` more columns: a kept one when it fits, else a
        new one (kept from then on)."""
        weights = _weights_key(model)
        for key in [k for k in self._decoders if k[-1] != weights]:  # the weights moved: these can never replay
            self._decoders.pop(key).close()
        needed = cache.columns + new_columns
        capacity = max(min(capacity_bucket(needed), model.config.text_config.max_position_embeddings), needed)
        key = (cache.lengths.shape[0], capacity, widest, weights)
        decoder = self._decoders.pop(key, None)
        if decoder is not None and not decoder.attach(cache):
            decoder.close()
            decoder = None
        if decoder is None:
            decoder = DeepseekV41CUDAGraphDecoder(model, cache, capacity - cache.columns, widest)
        self._decoders[key] = decoder
        while len(self._decoders) > self.max_decoders:
            self._decoders.popitem(last=False)[1].close()
        return decoder

    def keep(self, decoder: DeepseekV41CUDAGraphDecoder, model) -> None:
        """Detach `decoder` at the end of a call and key it by where the weights are now (the first steps may have
        moved them: the experts' stacked copies are built on the first accelerated step)."""
        decoder.detach()
        for key, kept in list(self._decoders.items()):
            if kept is decoder:
                del self._decoders[key]
                self._decoders[key[:-1] + (_weights_key(model),)] = decoder

    def __len__(self) -> int:
        return len(self._decoders)

    def nbytes(self) -> int:
        """Device memory held: the kept decoders' static cache buffers and what their recordings reserved."""
        return sum(decoder.nbytes() for decoder in self._decoders.values())

    def release(self) -> None:
        """Free every kept decoder (the next `generate(cuda_graphs=True)` records again)."""
        while self._decoders:
            self._decoders.popitem()[1].close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __deepcopy__(self, memo) -> DeepseekV41DecodeGraphs:
        return DeepseekV41DecodeGraphs(self.max_decoders)  # recordings belong to the original's weights

    def __getstate__(self) -> dict:
        return {"max_decoders": self.max_decoders, "_decoders": OrderedDict()}


def _weights_key(model) -> int:
    """Where the model's tensors are: recordings read them there, so another placement needs new ones."""
    return hash(tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers())))


class GenerationGraphs:
    """One `generate(..., cuda_graphs=True)` call's replays: its decode steps (and with DSpark its verify steps of
    up to `widest` tokens and its drafts) go through a decoder from `model.decode_graphs`, attached after the
    prompt's forward with room for the rest of `max_length`, and detached when the call ends."""

    def __init__(self, model, cache: DeepseekV41Cache, max_length: int, widest: int = 1) -> None:
        self.model, self.cache, self.max_length, self.widest = model, cache, max_length, widest
        self._decoder: DeepseekV41CUDAGraphDecoder | None = None
        self._recorded_before = 0
        self.running = False  # the decoder's own forward calls (its eager and recording steps) run the model

    def handles(self, cache, input_ids: torch.Tensor, pixel_values) -> bool:
        """A decode or verify step of this generation (its attention mask's new columns are always 1, so it is
        not needed)."""
        return (not self.running and cache is self.cache and 1 <= input_ids.shape[1] <= self.widest
                and cache.columns > 0 and not cache.pending_replay and pixel_values is None)

    def decoder(self) -> DeepseekV41CUDAGraphDecoder:
        if self._decoder is None:  # a verify step may write widest - 1 columns past max_length
            room = self.max_length - self.cache.columns + self.widest - 1
            self._decoder = self.model.decode_graphs.decoder_for(self.model, self.cache, room, self.widest)
            self._recorded_before = self._decoder.recorded
        return self._decoder

    @property
    def recorded(self) -> int:
        """Graphs this call recorded (0 when an earlier call's recordings served it)."""
        return self._decoder.recorded - self._recorded_before if self._decoder is not None else 0

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        decoder = self.decoder()
        self.running = True
        try:
            return decoder.step(input_ids)
        finally:
            self.running = False

    def draft(self, next_ids: torch.Tensor) -> Draft:
        """A greedy DSpark draft (`dspark_draft`), replayed."""
        model, cache = self.model, self.cache
        draft = self.decoder().call("draft", lambda ids: dspark_draft(model, ids, cache), next_ids)
        return Draft(*(t.clone() for t in draft))

    def draft_forward(self, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's forward (`draft_forward`), replayed: sampled drafts are chosen from it eagerly, before the
        next replay overwrites the returned buffers (`choose_drafts` only reads them)."""
        model, cache = self.model, self.cache
        return self.decoder().call("draft forward", lambda ids: draft_forward(model, ids, cache), next_ids)

    def close(self) -> None:
        if self._decoder is not None:
            self.model.decode_graphs.keep(self._decoder, self.model)
