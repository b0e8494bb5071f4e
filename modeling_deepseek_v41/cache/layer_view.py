"""A per-layer view of DeepseekV41Cache for transformers' Cache API (`cache.layers`, `len(cache)`): generate()
reads the layers' kinds (attention, not recurrent) and lengths, and the Cache's own queries (`get_seq_length`,
`get_mask_sizes`, `batch_size`, `is_compileable`, ...) are answered by its layers, as transformers' Cache does. The
state itself is shared between layers (pools are read by several layers), so changes go through the whole cache."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class DeepseekV41LayerView(CacheLayerMixin):
    """Layer `layer_idx` of a DeepseekV41Cache: an attention layer whose length is the cache's column count."""

    is_compileable = False
    is_croppable = True
    is_sliding = False  # every layer also reads the compressed pools of the whole context
    supports_early_init = False  # allocated by the cache's first forward, not by early_initialization

    def __init__(self, cache, layer_idx: int) -> None:
        self.cache, self.layer_idx = cache, layer_idx

    def __repr__(self) -> str:
        return f"DeepseekV41LayerView(layer_idx={self.layer_idx}, columns={self.cache.columns})"

    @property
    def is_initialized(self) -> bool:
        return self.cache.is_initialized

    @property
    def batch_size(self) -> int:
        lengths = self.cache.lengths
        return -1 if lengths is None else int(lengths.shape[0])

    def get_seq_length(self) -> int:
        return self.cache.columns  # input columns consumed, padding included, as generate() counts them

    def get_max_length(self) -> int:
        return -1  # no maximum: the pools and the history grow

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.columns + query_length, 0

    def _whole_cache_only(self, name: str):
        raise ValueError(f"DeepseekV41Cache layers share their pools: call cache.{name}(...) on the whole cache, "
                         f"not on cache.layers[{self.layer_idx}].")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._whole_cache_only("lazy_initialization")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise ValueError("DeepseekV41Cache is written by the model's forward (packed pools and FP8 windows), not "
                         "through Cache.update(key_states, value_states).")

    def reset(self) -> None:
        self._whole_cache_only("reset")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._whole_cache_only("reorder_cache")

    def crop(self, max_length: int) -> None:
        self._whole_cache_only("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache_only("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._whole_cache_only("batch_select_indices")
