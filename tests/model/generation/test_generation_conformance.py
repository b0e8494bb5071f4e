"""Generation conformance (what transformers' GenerationTesterMixin checks, which its sdist does not ship): every
decoding mode equal with and without the cache, continuation and multi-turn reuse of a returned cache with left
padding, return_dict_in_generate outputs, cache_implementation choices, batched equal to one-at-a-time, and the
per-layer Cache API that generate() reads."""

from __future__ import annotations

import pytest
import torch

from model_factory import random_model
from modeling_deepseek_v41.cache import DeepseekV41Cache

PAD = 2
GREEDY = dict(do_sample=False, pad_token_id=PAD)


@pytest.fixture(scope="module")
def model():
    return random_model(dtype=torch.float64, seed=21).eval()


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded to the longest: (ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, 60, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def extend(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask, mask.new_ones(mask.shape[0], width - mask.shape[1])], dim=1)


def run(model, ids, mask, seed: int | None = None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **kwargs)


MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.5),
    "beam": dict(do_sample=False, num_beams=2),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_cached_equals_uncached(model, mode):
    """Greedy, seeded sampling and beam search give the same tokens with the cache as when every step re-reads
    the whole sequence (use_cache=False), on a left-padded batch."""
    ids, mask = left_padded([9, 6])
    common = dict(max_new_tokens=4, min_new_tokens=4, pad_token_id=PAD, **MODES[mode])
    cached = run(model, ids, mask, seed=5, **common)
    uncached = run(model, ids, mask, seed=5, use_cache=False, **common)
    assert cached.shape == (2, 9 + 4)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("drafting", ["assistant_model", "prompt_lookup"])
def test_assisted_decoding_equals_greedy_without_cache(model, drafting):
    """Assisted decoding (the model as its own assistant) and prompt-lookup decoding verify drafts through the
    cache, crop rejected ones, and end with greedy's tokens computed without any cache."""
    ids, mask = left_padded([14], seed=1)
    ids = torch.cat([ids, ids[:, 3:9]], dim=1)  # a repeated span gives prompt lookup something to draft from
    mask = torch.ones_like(ids)
    extra = dict(assistant_model=model) if drafting == "assistant_model" else dict(prompt_lookup_num_tokens=3)
    common = dict(max_new_tokens=6, min_new_tokens=6, **GREEDY)
    drafted = run(model, ids, mask, **common, **extra)
    plain = run(model, ids, mask, use_cache=False, **common)
    assert torch.equal(drafted, plain)


def test_continuation_from_a_returned_cache(model):
    """3 tokens, then 3 more from the returned cache (left-padded batch; passed by transformers' older name
    past_key_values, the multi-turn test passes cache=), equal one 6-token generate."""
    ids, mask = left_padded([12, 7], seed=2)
    common = dict(min_new_tokens=3, max_new_tokens=3, **GREEDY)
    first = run(model, ids, mask, return_dict_in_generate=True, **common)
    assert isinstance(first.cache, DeepseekV41Cache) and first.cache.get_seq_length() == ids.shape[1] + 2
    sequences = first.sequences
    more = run(model, sequences, extend(mask, sequences.shape[1]), past_key_values=first.cache, **common)
    whole = run(model, ids, mask, max_new_tokens=6, min_new_tokens=6, **GREEDY)
    assert torch.equal(more, whole)


def test_multi_turn_reuse_of_one_cache(model):
    """Three generate() calls continue one cache, new user text appended between them (left-padded batch): the
    last reply equals one generate over the whole conversation's ids without a cache."""
    ids, mask = left_padded([11, 5], seed=3)
    common = dict(min_new_tokens=3, max_new_tokens=3, **GREEDY)
    cache = DeepseekV41Cache(model.config)
    generator = torch.Generator().manual_seed(4)
    for turn in range(3):
        if turn:
            user = torch.randint(3, 60, (ids.shape[0], 4 + turn), generator=generator)
            ids = torch.cat([ids, user], dim=1)
        mask = extend(mask, ids.shape[1])
        ids = run(model, ids, mask, cache=cache, **common)
        assert cache.get_seq_length() == ids.shape[1] - 1  # the last token is fed by the next call
    prompt = ids[:, :-3]
    replay = run(model, prompt, extend(mask, prompt.shape[1]), use_cache=False, **common)
    assert torch.equal(ids, replay)


def test_return_dict_in_generate_outputs(model):
    """Scores and logits per new token (equal to a cache-free forward over the sequence so far), hidden states
    per step (embedding then every layer, the prompt's width at the first step), and the cache."""
    ids, mask = left_padded([8, 5], seed=6)
    new = 4
    out = run(model, ids, mask, max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True,
              output_scores=True, output_logits=True, output_hidden_states=True, **GREEDY)
    layers = model.config.text_config.num_hidden_layers
    assert len(out.scores) == len(out.logits) == len(out.hidden_states) == new
    assert len(out.hidden_states[0]) == layers + 1 and out.hidden_states[0][0].shape[1] == ids.shape[1]
    assert all(step[-1].shape[1] == 1 for step in out.hidden_states[1:])
    for i in range(new):
        prefix = out.sequences[:, : ids.shape[1] + i]
        with torch.no_grad():
            expected = model(prefix, attention_mask=extend(mask, prefix.shape[1]), use_cache=False).logits[:, -1]
        torch.testing.assert_close(out.logits[i], expected.to(out.logits[i].dtype), rtol=0, atol=1e-9)
        assert torch.equal(out.scores[i].argmax(-1), out.sequences[:, ids.shape[1] + i])
    assert isinstance(out.cache, DeepseekV41Cache) and len(out.cache) == layers
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


def test_cache_implementation_choices(model):
    """None and "dynamic" are the model's own growing cache; "static" is the CUDA-graph static cache (refused on
    CPU, naming the device); every other implementation is refused with the supported list."""
    ids, mask = left_padded([6, 4], seed=7)
    common = dict(max_new_tokens=2, **GREEDY)
    default = run(model, ids, mask, **common)
    assert torch.equal(run(model, ids, mask, cache_implementation="dynamic", **common), default)
    with pytest.raises(ValueError, match="CUDA device"):
        run(model, ids, mask, cache_implementation="static", **common)
    for other in ("offloaded", "quantized", "offloaded_static", "sliding_window"):
        with pytest.raises(ValueError, match=f"cache_implementation='{other}' is not supported.*'static'"):
            run(model, ids, mask, cache_implementation=other, **common)
    config = model.generation_config.__class__(**common, cache_implementation="quantized")
    with pytest.raises(ValueError, match="not supported"):
        model.generate(ids, attention_mask=mask, generation_config=config)
    assert model.generation_config.cache_implementation is None  # the model's config is never changed


def test_batched_equals_one_at_a_time(model):
    """A left-padded batch gives each row the tokens it gets alone, unpadded."""
    lengths = [10, 4, 7]
    ids, mask = left_padded(lengths, seed=8)
    common = dict(max_new_tokens=4, min_new_tokens=4, **GREEDY)
    batched = run(model, ids, mask, **common)
    for row, length in enumerate(lengths):
        alone = ids[row: row + 1, ids.shape[1] - length:]
        single = run(model, alone, torch.ones_like(alone), **common)
        assert torch.equal(batched[row: row + 1, ids.shape[1] - length:], single)


def test_per_layer_cache_api(model):
    """What generate() reads: one attention layer per backbone layer (none recurrent), each layer's length and
    mask sizes, not compileable; batch operations on the whole cache act per row; per-layer edits are refused."""
    ids, mask = left_padded([6, 3], seed=9)
    cache = DeepseekV41Cache(model.config)
    layers = model.config.text_config.num_hidden_layers
    assert len(cache) == layers and not any(cache.is_linear) and cache.get_seq_length() == 0
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        step = torch.tensor([[7], [8]])
        reference = model(step, attention_mask=extend(mask, 7), cache=_prefilled(model, ids, mask)).logits
    assert [cache.get_seq_length(i) for i in range(layers)] == [6] * layers
    assert cache.get_mask_sizes(2, layers - 1) == (8, 0) and not cache.is_compileable and cache.is_croppable
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4
    cache.batch_select_indices(torch.tensor([2, 1]))  # rows: prompt 1, prompt 0
    with torch.no_grad():
        swapped = model(step.flip(0), attention_mask=extend(mask, 7).flip(0), cache=cache).logits
    torch.testing.assert_close(swapped, reference.flip(0), rtol=0, atol=0)
    with pytest.raises(ValueError, match="on the whole cache"):
        cache.layers[0].crop(3)


def _prefilled(model, ids, mask) -> DeepseekV41Cache:
    cache = DeepseekV41Cache(model.config)
    model(ids, attention_mask=mask, cache=cache)
    return cache
