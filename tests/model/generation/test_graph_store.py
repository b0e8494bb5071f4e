"""The recordings `generate(cuda_graphs=True)` keeps between calls (`model.decode_graphs`): one decoder per batch
rows, capacity bucket and verify width, reused by a later cache that fits, bounded, reported and released. The
bookkeeping runs on the CPU (nothing is recorded here: recording and replay are checked in gpu/test_cuda.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from model_factory import random_model, tiny_config
from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.model.generation import graph_decoder
from modeling_deepseek_v41.model.generation.graph_store import (SMALLEST_CAPACITY, DeepseekV41DecodeGraphs,
                                                                 capacity_bucket)


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(graph_decoder, "check_graph_decoding", lambda model: None)  # decoders on the CPU
    return random_model(tiny_config(), dtype=torch.float32).eval()


def _prefilled(model, rows: int, length: int, dspark: bool = False) -> DeepseekV41Cache:
    cache = DeepseekV41Cache(model.config, dspark=dspark)
    ids = torch.randint(3, 500, (rows, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    return cache


def test_capacity_buckets_are_powers_of_two():
    assert capacity_bucket(1) == capacity_bucket(SMALLEST_CAPACITY) == SMALLEST_CAPACITY
    assert capacity_bucket(SMALLEST_CAPACITY + 1) == 2 * SMALLEST_CAPACITY
    assert capacity_bucket(5000) == 8192


def test_a_later_call_of_the_same_shape_gets_the_kept_decoder(model):
    graphs = DeepseekV41DecodeGraphs(max_decoders=2)
    first = _prefilled(model, 1, 20)
    decoder = graphs.decoder_for(model, first, 16, widest=1)
    assert decoder.capacity == SMALLEST_CAPACITY and first.is_static
    decoder.detach()
    assert not first.is_static and first.static_parts()[0] is not decoder.parts[0]  # the call's cache: copies
    with pytest.raises(ValueError, match="holds no cache"):
        decoder.step(torch.ones(1, 1, dtype=torch.long))

    later = _prefilled(model, 1, 37)  # another prompt length, the same bucket
    assert graphs.decoder_for(model, later, 16, widest=1) is decoder
    assert later.static_parts() == decoder.parts and later.columns == 37
    decoder.detach()

    assert graphs.decoder_for(model, _prefilled(model, 2, 20), 16, widest=1) is not decoder  # other rows
    assert len(graphs) == 2
    graphs.decoder_for(model, _prefilled(model, 1, 20, dspark=True), 16, widest=6).detach()  # the oldest goes
    assert len(graphs) == 2 and decoder.parts is None
    assert graphs.nbytes() > 0
    graphs.release()
    assert len(graphs) == 0 and graphs.nbytes() == 0


def test_a_cache_that_does_not_fit_gets_a_new_decoder(model):
    graphs = DeepseekV41DecodeGraphs()
    decoder = graphs.decoder_for(model, _prefilled(model, 1, 20), 16, widest=1)
    decoder.detach()
    drafting = _prefilled(model, 1, 20, dspark=True)  # drafter rings: another layout in the same bucket
    other = graphs.decoder_for(model, drafting, 16, widest=1)
    assert other is not decoder and drafting.static_parts() == other.parts and decoder.parts is None


def test_recordings_of_moved_weights_are_released(model):
    graphs = DeepseekV41DecodeGraphs()
    decoder = graphs.decoder_for(model, _prefilled(model, 1, 20), 16, widest=1)
    decoder.detach()
    moved = copy.deepcopy(model)  # its tensors live elsewhere: the recordings would read the old ones
    graphs.decoder_for(moved, _prefilled(moved, 1, 20), 16, widest=1).detach()
    assert len(graphs) == 1 and decoder.parts is None


def test_a_copied_model_does_not_share_recordings(model):
    graphs = model.decode_graphs
    graphs.decoder_for(model, _prefilled(model, 1, 20), 16, widest=1).detach()
    assert len(copy.deepcopy(model).decode_graphs) == 0 and len(model.decode_graphs) == 1
    model.decode_graphs.release()
