"""The random hub-layout checkpoint maker and its tiny tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modeling_deepseek_v41  # noqa: F401  (registers the Auto classes)
from conversion_scripts.make_random_checkpoint import main as make_main, make_random_checkpoint
from conversion_scripts.presets import engram_table_rows
from conversion_scripts.streaming import partial_dir
from conversion_scripts.tiny_tokenizer import CHAT_TOKENS, IMAGE_TOKEN, NOISE_TOKEN, save_tiny_tokenizer
from modeling_deepseek_v41.model.checkpoint import validate_checkpoint_folder
from repo_paths import FIXTURES, ROOT

FIXTURE_CONFIG = FIXTURES / "tiny-text" / "checkpoint" / "config.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("random") / "tiny", seed=3)


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("random") / "tiny-vision", vision=True, seed=4)


def test_hub_wrapper_config(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["model_type"] == "deepseek_v41"
    assert config["vision_config"] is None
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                             "expert_dtype": "fp4"}
    text = config["text_config"]
    assert config["image_token_id"] == text["vocab_size"] - 16
    assert text["dspark_noise_token_id"] == text["vocab_size"] - 8
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tiny / s).exists() for s in shards)
    assert index["metadata"]["total_size"] > 0
    assert (tiny / "generation_config.json").exists()
    assert not partial_dir(tiny).exists()


def test_engram_sizes_follow_the_model_rules():
    fixture = json.loads(FIXTURE_CONFIG.read_text())["text_config"]
    rows = engram_table_rows(fixture["engram_layer_ids"], fixture["engram_max_ngram_size"],
                             fixture["engram_vocab_size"], fixture["engram_n_heads"])
    assert rows == fixture["engram_num_embeddings"]


@pytest.mark.parametrize("which", ["tiny", "tiny_vision"])
@pytest.mark.parametrize("mode", ["quantized", "bf16"])
def test_loads_with_no_missing_keys_and_finite_logits(request, which, mode):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = request.getfixturevalue(which)
    validate_checkpoint_folder(folder, AutoConfig.from_pretrained(folder))
    model, info = AutoModelForCausalLM.from_pretrained(folder, weight_mode=mode, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(["Beautiful is better than ugly. Explicit is better than implicit."], return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id == 0
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.1  # not degenerate
    assert logits.argmax(-1).unique().numel() > 1


def test_seeded_and_deterministic(tmp_path):
    a = make_random_checkpoint(tmp_path / "a", seed=7)
    b = make_random_checkpoint(tmp_path / "b", seed=7)
    c = make_random_checkpoint(tmp_path / "c", seed=8)
    shard = "model-00001-of-00002.safetensors"
    assert (a / shard).read_bytes() == (b / shard).read_bytes()
    assert (a / shard).read_bytes() != (c / shard).read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_overrides_and_presets(tmp_path):
    from transformers import AutoConfig

    folder = make_random_checkpoint(tmp_path / "wide", {"vocab_size": 640, "hidden_size": 192}, max_shard_size="1MB")
    config = AutoConfig.from_pretrained(folder)
    assert config.text_config.vocab_size == 640 and config.image_token_id == 624
    validate_checkpoint_folder(folder, config)
    small = make_random_checkpoint(tmp_path / "small", preset="small")
    validate_checkpoint_folder(small, AutoConfig.from_pretrained(small))


def test_tokenizer_layout(tmp_path):
    from transformers import AutoTokenizer

    ids = save_tiny_tokenizer(tmp_path, 400)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 400
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    assert (ids.image_token_id, ids.noise_token_id) == (384, 392)
    assert tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, NOISE_TOKEN]) == [384, 392]
    for token in CHAT_TOKENS:
        assert tokenizer(token, add_special_tokens=False).input_ids == [tokenizer.convert_tokens_to_ids(token)]


def test_reserved_ids_in_the_vocabulary_keep_the_tokenizer(tmp_path):
    """reserved_in_vocab (the loading benchmark's tokenizer of the released size) moves the ids no merge reaches
    from added tokens into the vocabulary: the same ids, encodings, decodings and Engram map, few added tokens."""
    from transformers import AutoTokenizer

    from modeling_deepseek_v41.layers.engram_hashing import build_compressed_token_map

    loaded = []
    for flag in (False, True):
        ids = save_tiny_tokenizer(tmp_path / str(flag), 8192, reserved_in_vocab=flag)
        loaded.append((ids, AutoTokenizer.from_pretrained(tmp_path / str(flag))))
    (ids, added), (ids_in_vocab, in_vocab) = loaded
    assert ids == ids_in_vocab and in_vocab.get_vocab() == added.get_vocab()
    text = "Beautiful is better than ugly. <｜User｜>hi<｜Assistant｜> x = {'a': 1}\n"
    assert in_vocab(text).input_ids == added(text).input_ids
    assert in_vocab.decode(range(8192)) == added.decode(range(8192))
    assert build_compressed_token_map(in_vocab) == build_compressed_token_map(added)
    assert len(in_vocab.added_tokens_decoder) < 32 < len(added.added_tokens_decoder)


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_main(["--help"])
    assert exit_info.value.code == 0 and "--preset" in capsys.readouterr().out
    assert make_main(["--out", str(tmp_path / "bad"), "--set", "num_hidden_layers=3", "--quiet"]) == 1
    assert not (tmp_path / "bad").exists() and not partial_dir(tmp_path / "bad").exists()
    result = subprocess.run(
        [sys.executable, "-m", "conversion_scripts.make_random_checkpoint", "--out", str(tmp_path / "cli"),
         "--seed", "1", "--no-vision", "--quiet"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert make_main(["--out", str(tmp_path / "cli"), "--quiet"]) == 4
