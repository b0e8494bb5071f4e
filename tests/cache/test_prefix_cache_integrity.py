"""A saved prefix cache restores only into the model that wrote it, and a corrupted or edited file is refused."""

from __future__ import annotations

import copy
import json
import struct
import threading

import pytest
import torch

from model_factory import random_model
from modeling_deepseek_v41.cache import DeepseekV41Cache

PREFIX, SUFFIX = 12, 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model, a saved 12-token prefix and the logits of the 4-token suffix after restoring it."""
    model = random_model(dtype=torch.float64, seed=11)
    ids = torch.randint(3, 500, (1, PREFIX + SUFFIX), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(ids[:, :PREFIX], cache=cache)
    path = cache.save(tmp_path_factory.mktemp("cache") / "prefix.cache", model)
    return model, ids, path, _suffix_logits(model, ids, path)


def _suffix_logits(model, ids, path):
    with torch.no_grad():
        return model(ids[:, PREFIX:], cache=DeepseekV41Cache.load(path, model)).logits


def test_restore_into_a_model_with_other_expert_weights_is_refused(saved):
    model, _, path, _ = saved
    tuned = copy.deepcopy(model)
    with torch.no_grad():  # an expert-only fine-tune of one element in a layer that feeds the pools
        tuned.model.layers[1].ffn.experts[0].w1.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="weights that produce the stored KV differ"):
        DeepseekV41Cache.load(path, tuned)


def test_restore_into_a_model_with_another_token_map_is_refused(saved):
    model, _, path, _ = saved
    other = copy.deepcopy(model)
    other.model.engram_token_map[7] = (other.model.engram_token_map[7] + 1) % other.config.text_config.engram_compressed_vocab_size
    with pytest.raises(ValueError, match="Engram token map differs"):
        DeepseekV41Cache.load(path, other)


@pytest.mark.parametrize("field, value", [("index_topk", 2), ("rms_norm_eps", 1e-5), ("sliding_window", 4)])
def test_restore_into_a_model_with_another_config_field_is_refused(saved, field, value):
    model, _, path, _ = saved
    other = copy.deepcopy(model)
    assert getattr(other.config.text_config, field) != value
    setattr(other.config.text_config, field, value)
    with pytest.raises(ValueError, match=f"config differs: {field} "):
        DeepseekV41Cache.load(path, other)


def test_weights_that_do_not_feed_the_pools_may_change(saved):
    """The output head and the drafter do not shape the stored KV: a head-only fine-tune keeps the prefix."""
    model, ids, path, _ = saved
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.lm_head.weight.mul_(1.5)
    DeepseekV41Cache.load(path, tuned)


def _rewrite_header(original: bytes, edit) -> bytes:
    length = struct.unpack("<Q", original[:8])[0]
    header = json.loads(original[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + original[8 + length:]


@pytest.mark.parametrize("edit", [
    lambda h: h["__metadata__"].update(columns="20"),
    lambda h: h["__metadata__"].update(cache_config=h["__metadata__"]["cache_config"].replace(
        '"index_topk": "', '"index_topk": "1')),
    lambda h: h["__metadata__"].update(weights_digest="sha256:" + "0" * 64),
    lambda h: h["tokens"].update(dtype="I32", shape=[h["tokens"]["shape"][1], 1]),
    lambda h: h["lengths"].update(dtype="F32") if h["lengths"]["dtype"] == "I32" else h["lengths"].update(dtype="I32"),
], ids=["columns", "index_topk", "weights_digest", "token_shape", "lengths_dtype"])
def test_header_edits_are_refused_by_the_checksum(saved, tmp_path, edit):
    model, _, path, _ = saved
    edited = tmp_path / "edited.cache"
    edited.write_bytes(_rewrite_header(path.read_bytes(), edit))
    with pytest.raises(ValueError, match="fails its checksum|not a readable saved cache"):
        DeepseekV41Cache.load(edited, model)


def test_every_flipped_byte_is_refused_or_harmless(saved, tmp_path):
    """Every byte of the header and every PAYLOAD_STRIDE-th byte of the payload, flipped in turn (xor 0xFF):
    refused with a ValueError, or restored with logits identical to the intact file's. The first and last 64 payload
    bytes are flipped too."""
    payload_stride = 7
    model, ids, path, reference = saved
    original = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    payload = range(header_end, len(original))
    offsets = sorted({*range(header_end), *payload[::payload_stride], *payload[:64], *payload[-64:]})
    flipped_file = tmp_path / "flipped.cache"
    refused = harmless = 0
    for offset in offsets:
        flipped = bytearray(original)
        flipped[offset] ^= 0xFF
        flipped_file.write_bytes(bytes(flipped))
        try:
            restored = DeepseekV41Cache.load(flipped_file, model)
        except ValueError:
            refused += 1
            continue
        with torch.no_grad():
            logits = model(ids[:, PREFIX:], cache=restored).logits
        assert torch.equal(logits, reference), f"flipping byte {offset} restored a different prefix"
        harmless += 1
    assert refused + harmless == len(offsets) and refused > 0
    print(f"{len(original)} bytes, {len(offsets)} flipped: {refused} refused, {harmless} harmless")


def test_two_writers_and_a_reader_on_one_path(saved, tmp_path):
    """Two threads save valid caches (two prefix lengths) to one path 20 times each while a third loads it: every
    load succeeds and sees one of the two complete files."""
    model, ids, _, _ = saved
    path = tmp_path / "shared.cache"
    caches = []
    with torch.no_grad():
        for length in (PREFIX, PREFIX + 2):
            cache = DeepseekV41Cache(model.config)
            model(ids[:, :length], cache=cache)
            caches.append(cache)
    caches[0].save(path, model)
    rounds, failures, seen = 20, [], set()
    writers_done = threading.Event()

    def write(cache):
        try:
            for _ in range(rounds):
                cache.save(path, model)
        except Exception as error:  # noqa: BLE001 - any writer failure fails the test below
            failures.append(error)

    def read():
        count = 0
        while count < rounds or not writers_done.is_set():
            try:
                seen.add(DeepseekV41Cache.load(path, model).columns)
            except Exception as error:  # noqa: BLE001 - any reader failure fails the test below
                failures.append(error)
            count += 1

    writers = [threading.Thread(target=write, args=(cache,)) for cache in caches]
    reader = threading.Thread(target=read)
    for thread in (*writers, reader):
        thread.start()
    for thread in writers:
        thread.join()
    writers_done.set()
    reader.join()
    assert failures == []
    assert seen <= {PREFIX, PREFIX + 2} and seen
    assert [p.name for p in tmp_path.iterdir()] == ["shared.cache"]  # no temporary file left behind
