"""Engram tables in host memory or memory-mapped from the checkpoint: the same lookups and logits as on the device,
rows gathered before the layers run, and host memory bounded by the rows touched, not the table size."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling_deepseek_v41  # noqa: F401
from modeling_deepseek_v41 import DeepseekV41Config
from modeling_deepseek_v41.layers.engram import DeepseekV41ExternalEngramTable
from modeling_deepseek_v41.loading.engram_storage import ExternalTable
from reference_cases import FIXTURES

CHECKPOINT = FIXTURES / "tiny-text" / "checkpoint"


@pytest.fixture(scope="module")
def device_model():
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT)


@pytest.mark.parametrize("storage", ["mmap", "host"])
def test_off_device_tables_give_the_same_lookups_and_logits(device_model, storage):
    model, info = AutoModelForCausalLM.from_pretrained(CHECKPOINT, engram_storage=storage, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    ids = torch.randint(3, 500, (2, 41), generator=torch.Generator().manual_seed(3))
    for layer in (1, 3):
        table = model.model.layers[layer].engram.embed
        assert isinstance(table, DeepseekV41ExternalEngramTable) and table.external.storage == storage
        rows = torch.randint(0, table.rows, (3, 17, 6), generator=torch.Generator().manual_seed(layer))
        assert torch.equal(table(rows), device_model.model.layers[layer].engram.embed(rows))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, device_model(ids).logits)
    # the forward issued every table's gather before the first layer, and each layer used it
    assert [model.model.layers[i].engram.embed.prefetch_hits for i in (1, 3)] == [1, 1]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def test_mapped_table_reads_only_the_rows_looked_up(tmp_path):
    """A 315 MiB FP8 table file (written sparsely: nothing but a few rows is on disk): looking up 1024 rows maps
    their pages only."""
    rows, width = 10_000_000, 32
    header = {"t.weight": {"dtype": "F8_E4M3", "shape": [rows, width], "data_offsets": [0, rows * width]},
              "t.scale": {"dtype": "F8_E8M0", "shape": [rows, 1], "data_offsets": [rows * width, rows * (width + 1)]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)
    written = torch.tensor([5, 1_234_567, rows - 1])
    values = torch.randn(len(written), width).to(torch.float8_e4m3fn)
    scales = torch.tensor([[2.0], [0.5], [8.0]]).to(torch.float8_e8m0fnu)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(data_start + rows * (width + 1))
        for i, row in enumerate(written.tolist()):
            handle.seek(data_start + row * width)
            handle.write(values[i].view(torch.uint8).numpy().tobytes())
            handle.seek(data_start + rows * width + row)
            handle.write(scales[i].view(torch.uint8).numpy().tobytes())
    size = os.path.getsize(path)

    table = ExternalTable.from_checkpoint(tmp_path, "t", quantized=True, storage="mmap")
    resident, private = _rss_kib("VmRSS"), _rss_kib("RssAnon")
    ids = torch.randint(0, rows, (4, 32, 8), generator=torch.Generator().manual_seed(0))
    ids[0, 0, :3] = written
    weight, scale, _ = table.gather(ids, torch.device("cpu"))
    grown, grown_private = (_rss_kib("VmRSS") - resident) * 1024, (_rss_kib("RssAnon") - private) * 1024
    assert torch.equal(weight[0, 0, :3].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(scale[0, 0, :3].view(torch.uint8), scales.view(torch.uint8))
    assert bool((weight[1:].view(torch.uint8) == 0).all())  # never-written rows read as the file's zeros
    # at most one page of weights and one of scales per row looked up (plus allocator noise), not the file
    assert grown < 2 * ids.numel() * 4096 + (4 << 20) and grown < size / 10
    assert grown_private < (4 << 20)


def test_engram_storage_is_a_placement_choice():
    config = DeepseekV41Config(**json.loads((CHECKPOINT / "config.json").read_text()))
    with pytest.raises(ValueError, match="engram_storage must be one of"):
        config.engram_storage = "ssd"
    config.engram_storage = "mmap"
    assert "engram_storage" not in config.to_json_string()  # not a property of the checkpoint


def test_saving_with_off_device_tables_is_refused(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, engram_storage="mmap")
    with pytest.raises(ValueError, match="Engram tables are not parameters"):
        model.save_pretrained(tmp_path)
