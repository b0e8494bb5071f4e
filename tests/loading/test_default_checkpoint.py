"""The shipped default checkpoint (examples/default-checkpoint): it loads through the hub loader as stored, answers
the fixed held-out picture questions, and its drafter is accepted."""

from __future__ import annotations

import json
import sys

import pytest

from default_checkpoint_thresholds import (ACCEPTED_LENGTH_THRESHOLD, ACCURACY_THRESHOLD,
                                           PICTURE_ACCEPTED_LENGTH_THRESHOLD)
from repo_paths import DEFAULT_CHECKPOINT, ROOT

sys.path.insert(0, str(ROOT))

CHECKPOINT = DEFAULT_CHECKPOINT

pytestmark = pytest.mark.skipif(not CHECKPOINT.exists(), reason="examples/default-checkpoint is not built")


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT).eval()
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    return model, processor


def test_stored_in_the_hub_layout_and_small():
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert "quantization_config" in config and config["vision_config"] is not None
    text = config["text_config"]
    assert text["num_nextn_predict_layers"] > 0 and text["engram_layer_ids"]
    assert text["candidate_source_layer_id"] is not None and set(text["compress_ratios"]) >= {0, 1, 2}
    size = sum(p.stat().st_size for p in CHECKPOINT.iterdir() if p.is_file())
    assert size < 30 * 2**20


def test_heldout_image_question_accuracy(loaded):
    from training.evaluate import image_question_accuracy

    model, processor = loaded
    assert model.config.weight_mode == "quantized"
    accuracy = image_question_accuracy(model, processor)
    assert accuracy >= ACCURACY_THRESHOLD


def test_drafter_is_accepted_and_lossless(loaded):
    from training.evaluate import drafting_stats

    model, processor = loaded
    stats = drafting_stats(model, processor, max_new_tokens=24, n_text=3, n_images=2)
    assert stats["text"]["same_tokens"] and stats["image"]["same_tokens"]
    assert stats["text"]["mean_accepted_length"] >= ACCEPTED_LENGTH_THRESHOLD
    assert stats["image"]["mean_accepted_length"] >= PICTURE_ACCEPTED_LENGTH_THRESHOLD


def test_later_turn_with_one_cache_equals_the_turn_from_scratch(loaded):
    """Turn 2 repeats turn 1's picture and adds another: with turn 1's cache only its new part runs (the cached
    picture is not embedded again) and it gives the tokens of turn 2 run without a cache."""
    import torch

    from modeling_deepseek_v41.cache import DeepseekV41Cache
    from training.data import ShapeSample, draw_shape

    model, processor = loaded
    circle = draw_shape(ShapeSample("circle", "red", (63.0, 63.0), 36.0, 0.0, (255, 255, 255)))
    square = draw_shape(ShapeSample("square", "blue", (60.0, 66.0), 30.0, 0.0, (255, 255, 255)))
    turn = [{"role": "user", "content": [{"type": "image", "image": circle}, {"type": "text", "text": "What shape is in the picture?"}]}]
    greedy = dict(max_new_tokens=6, do_sample=False)

    def prompt(messages):
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                             return_tensors="pt")

    cache = DeepseekV41Cache(model.config)
    first = prompt(turn)
    reply = model.generate(**first, cache=cache, **greedy)[0, first["input_ids"].shape[1]:]
    turn += [{"role": "assistant", "content": processor.decode(reply, skip_special_tokens=True)},
             {"role": "user", "content": [{"type": "image", "image": square}, {"type": "text", "text": "And here?"}]}]
    second = prompt(turn)
    assert second["image_grids"].shape[0] == 2 and torch.equal(
        second["input_ids"][:, :cache.get_seq_length()], torch.cat([first["input_ids"], reply[None, :-1]], 1))
    continued = model.generate(**second, cache=cache, **greedy)
    assert torch.equal(continued, model.generate(**second, **greedy))
