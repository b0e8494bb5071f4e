"""Usability findings of issue 20, each as the command a user types, on the embedded default checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoProcessor

import modeling_deepseek_v41  # noqa: F401
from repo_paths import DEFAULT_CHECKPOINT

CHECKPOINT = DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT)


@pytest.fixture(scope="module")
def picture_inputs():
    """Processor outputs for a chat with a picture: input_ids, attention_mask, token_types, pixel_values, ..."""
    import random

    from training.data import qa_example, random_sample

    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    example = qa_example(random_sample(random.Random(4)), 1)
    inputs = processor.apply_chat_template(example["messages"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    assert "token_types" in inputs and (inputs["token_types"] >= 0).any()
    return dict(inputs)


def _greedy(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=6, do_sample=False, **kwargs)


def test_dtype_float32_is_honoured_in_the_bf16_weight_mode():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16", dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == torch.float32
    default = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16")
    assert torch.bfloat16 in {p.dtype for p in default.parameters()}  # the default stays the checkpoint's


def test_dtype_float32_with_quantized_weights_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"weight_mode=\"bf16\""):
        AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)


def test_use_cache_false_with_processor_outputs(model, picture_inputs):
    expected = _greedy(model, picture_inputs)
    assert torch.equal(_greedy(model, picture_inputs, use_cache=False), expected)


def test_assistant_model_with_processor_outputs(model, picture_inputs):
    expected = _greedy(model, picture_inputs)
    assistant = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    assert torch.equal(_greedy(model, picture_inputs, assistant_model=assistant), expected)


def test_dspark_with_beam_search_is_refused(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="beam"):
        model.generate(ids, max_new_tokens=4, use_dspark=True, num_beams=2)


def test_dspark_with_several_rows_is_refused_before_any_work(model):
    """DSpark drafts one sequence: a batch of prompts (or several returned sequences) is refused with what to use
    instead, before the prompt runs (a cache given to the call stays empty)."""
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    cache = DeepseekV41Cache(model.config, dspark=True)
    with pytest.raises(ValueError, match="once per prompt.*use_dspark=False"):
        model.generate(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), max_new_tokens=4, use_dspark=True, cache=cache)
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="2 rows"):
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, use_dspark=True, do_sample=True,
                       num_return_sequences=2)


def test_unknown_cache_implementation_is_refused(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, max_new_tokens=4, cache_implementation="offloaded_hybrid")


def test_num_parameters_counts_weights_not_stored_elements(model):
    dense = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16")
    assert model.num_parameters() == dense.num_parameters()
    stored = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() != stored  # FP4 bytes hold two weights; E8M0 scales are not weights
    assert model.get_memory_footprint() < dense.get_memory_footprint()
