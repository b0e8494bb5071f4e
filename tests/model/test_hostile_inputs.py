"""Hostile inputs, weights and checkpoint folders: each refused with an error that names the problem."""

from __future__ import annotations

import pytest
import torch

from model_factory import random_model
from modeling_deepseek_v41.cache import DeepseekV41Cache
from reference_cases import FIXTURES

CHECKPOINT = FIXTURES / "tiny-text" / "checkpoint"


@pytest.fixture(scope="module")
def model():
    return random_model(dtype=torch.float64, seed=5)


def _ids(batch=2, seq=6):
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(1))


def _mask(batch=2, seq=6):
    return torch.ones(batch, seq, dtype=torch.long)


def _all_masked_row():
    mask = _mask()
    mask[1] = 0
    return mask


def _image_span_types():
    types = torch.full((2, 6), -1)
    types[0, 2:4] = 0
    return types


BAD_INPUTS = {
    "empty": (dict(input_ids=_ids(2, 0)), "input_ids is empty"),
    "id_too_large": (dict(input_ids=torch.full((1, 3), 512)), "token id 512, outside the vocabulary"),
    "negative_id": (dict(input_ids=torch.tensor([[5, -3, 7]])), "token id -3, outside the vocabulary"),
    "float_ids": (dict(input_ids=_ids().float()), "input_ids must be an integer tensor"),
    "one_dim_ids": (dict(input_ids=_ids()[0]), r"shape \[batch, sequence\]"),
    "longer_mask": (dict(input_ids=_ids(), attention_mask=_mask(2, 8)), "attention_mask covers 8 columns"),
    "mask_batch": (dict(input_ids=_ids(), attention_mask=_mask(3, 6)), "one row per input row"),
    "all_masked_row": (dict(input_ids=_ids(), attention_mask=_all_masked_row()), "row 1 masks every token"),
    "image_without_pixels": (dict(input_ids=_ids(), token_types=_image_span_types()),
                             "image span but no pixel_values"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_forward_refuses_bad_input(model, case):
    kwargs, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        model(**kwargs)


@pytest.mark.parametrize("case", ["empty", "id_too_large", "longer_mask", "all_masked_row", "image_without_pixels"])
def test_generate_refuses_bad_input_before_any_work(model, case):
    kwargs, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs, max_new_tokens=2, do_sample=False, pad_token_id=2)


def test_a_mask_over_cache_and_chunk_is_accepted_and_checked(model):
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(_ids(), attention_mask=_mask(), cache=cache)
        model(_ids(2, 1), attention_mask=_mask(2, 7), cache=cache)  # cache plus chunk: valid
        with pytest.raises(ValueError, match=r"pass a mask of 1 \(the new tokens\) or 8"):
            model(_ids(2, 1), attention_mask=_mask(2, 5), cache=cache)


@pytest.mark.parametrize("indices, message", [
    (torch.tensor([0, 2]), "row index 2, but the cache holds 2 rows"),
    (torch.tensor([-1, 0]), "row index -1, but the cache holds 2 rows"),
    (torch.tensor([0.0, 1.0]), "integer row indices, got dtype torch.float32"),
    ([0, 1], "1-D LongTensor of row indices, got list"),
    (torch.tensor([[0, 1]]), "1-D tensor of row indices"),
], ids=["out_of_range", "negative", "float", "list", "two_dim"])
def test_reorder_cache_refuses_bad_indices_and_keeps_the_rows(model, indices, message):
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(_ids(), cache=cache)
    tokens = cache.log.tokens.view(0, cache.columns).clone()
    with pytest.raises(ValueError, match=message):
        cache.reorder_cache(indices)
    assert torch.equal(cache.log.tokens.view(0, cache.columns), tokens)


def test_a_cache_that_ends_inside_an_image_span_is_refused():
    """A prompt continues a cache after whole images only (its cached images are dropped, the others kept)."""
    from modeling_deepseek_v41.model.generation.mixin import uncached_images

    types = torch.tensor([[-1, 0, 1, 2, 3, -1, 0, 1, 1, 2, 3]])
    grids = torch.tensor([[2, 2, 1, 1], [2, 4, 1, 2]])
    pixels = torch.arange(12.0).view(12, 1, 1, 1)
    kept_pixels, kept_grids = uncached_images(types, pixels, grids, cached=6)
    assert torch.equal(kept_grids, grids[1:]) and torch.equal(kept_pixels, pixels[4:])
    assert uncached_images(types, pixels, grids, cached=11) == (None, None)
    with pytest.raises(ValueError, match="cache ends inside an image span"):
        uncached_images(types, pixels, grids, cached=3)


# -- numerics: non-finite weights and logits ---------------------------------------------------------------------

def test_generate_stops_on_all_nan_logits_even_when_removing_invalid_values(model):
    from modeling_deepseek_v41.model.generation import InvalidLogitsError

    broken = random_model(dtype=torch.float64, seed=5)
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    for remove in (False, True):
        with pytest.raises(InvalidLogitsError, match="every logit of row 0 is NaN"):
            broken.generate(_ids(), attention_mask=_mask(), max_new_tokens=3, do_sample=False, pad_token_id=2,
                            remove_invalid_values=remove)


@pytest.mark.parametrize("value, kind", [(float("inf"), r"\+inf"), (float("-inf"), "-inf")], ids=["pos", "neg"])
def test_generate_stops_on_infinite_logits_like_nan(model, value, kind):
    from modeling_deepseek_v41.model.generation import InvalidLogitsError

    hook = model.lm_head.register_forward_hook(lambda module, args, output: torch.full_like(output, value))
    try:
        for remove in (False, True):
            with pytest.raises(InvalidLogitsError, match=f"every logit of row 0 is {kind} after 6 tokens"):
                model.generate(_ids(), attention_mask=_mask(), max_new_tokens=3, do_sample=False, pad_token_id=2,
                               remove_invalid_values=remove)
    finally:
        hook.remove()


# -- generate() with a cache it cannot use ---------------------------------------------------------------------

def test_static_cache_on_the_cpu_names_cuda_graphs_and_the_cpu_choice(model):
    with pytest.raises(ValueError, match=r"cache_implementation='static' is DeepSeek-V4.1's CUDA-graph decoding.*"
                                         r"on cpu.*on the CPU, leave cache_implementation unset"):
        model.generate(_ids(), max_new_tokens=2, do_sample=False, pad_token_id=2, cache_implementation="static")


def test_a_transformers_cache_is_refused_naming_the_cache_to_use(model):
    from transformers import DynamicCache

    for name in ("past_key_values", "cache"):
        with pytest.raises(ValueError, match=r"got a DynamicCache.*pass DeepseekV41Cache\(model.config\)"):
            model.generate(_ids(), max_new_tokens=2, do_sample=False, pad_token_id=2, **{name: DynamicCache()})


def test_a_prompt_that_does_not_extend_its_cache_is_refused(model):
    """The same prompt again, a shorter one, one whose first columns differ from the cached tokens, or another
    number of rows."""
    cache = DeepseekV41Cache(model.config)
    ids = model.generate(_ids(), max_new_tokens=2, do_sample=False, pad_token_id=2, cache=cache)
    held = cache.get_seq_length()
    changed = ids.clone()
    changed[0, 1] += 1
    refused = "The prompt does not extend the cache: "
    for prompt, message in ((ids[:, :held], f"{refused}it has {held} columns and the cache already holds {held}"),
                            (ids[:, :3], f"{refused}it has 3 columns and the cache already holds {held}"),
                            (changed, f"{refused}its first {held} columns differ from the tokens the cache holds"),
                            (ids[:1], "The cache holds 2 rows but the prompt has 1")):
        with pytest.raises(ValueError, match=message):
            model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=2, cache=cache)
    assert cache.get_seq_length() == held  # nothing ran
    more = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2, cache=cache)
    assert more.shape[1] == ids.shape[1] + 1


def _checkpoint_with(tmp_path, edit):
    """A copy of the tiny fixture checkpoint whose first shard went through `edit(tensors)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def _nan_embedding(tensors):
    tensors["embed.weight"][3, 5] = float("nan")


def _nan_e8m0_scale(tensors):
    scale = tensors["layers.0.attn.wq_a.scale"]
    scale.view(torch.uint8)[0, 0] = 0xFF


@pytest.mark.parametrize("edit, name, kind", [
    (_nan_embedding, "embed.weight", "NaN or Inf"),
    (_nan_e8m0_scale, "layers.0.attn.wq_a.scale", "E8M0 scale byte 0xFF"),
], ids=["nan_weight", "e8m0_0xff"])
def test_non_finite_loaded_weights_are_named_unless_skipped(tmp_path, edit, name, kind):
    from transformers import AutoModelForCausalLM

    folder = _checkpoint_with(tmp_path, edit)
    with pytest.raises(ValueError, match=f"'{name}'.*{kind}.*check_finite=False"):
        AutoModelForCausalLM.from_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, check_finite=False)  # skipped on request: it loads
    broken = loaded.get_parameter(f"model.{name}").detach()  # the hub name under the base model
    assert bool(torch.isnan(broken.float()).any()) if broken.dtype != torch.float8_e8m0fnu else \
        bool((broken.view(torch.uint8) == 0xFF).any())


# -- checkpoint folders: corrupted JSON, wrong paths ----------------------------------------------------------------

def _break_index(folder):
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"embed.weight": ')


def _break_header(folder):
    import struct

    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    data[8:8 + length] = b"{" + b"x" * (length - 1)  # same length, not JSON
    shard.write_bytes(bytes(data))
    return shard.name


def test_index_that_is_not_json_is_named(tmp_path):
    from modeling_deepseek_v41 import DeepseekV41ForCausalLM

    folder = _checkpoint_with(tmp_path, lambda tensors: None)
    _break_index(folder)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: the index is not valid JSON"):
        DeepseekV41ForCausalLM.from_pretrained(folder)


def test_safetensors_header_that_is_not_json_is_named(tmp_path):
    from modeling_deepseek_v41 import DeepseekV41ForCausalLM

    folder = _checkpoint_with(tmp_path, lambda tensors: None)
    name = _break_header(folder)
    with pytest.raises(ValueError, match=f"{name}: its safetensors header is not valid JSON"):
        DeepseekV41ForCausalLM.from_pretrained(folder)


def test_a_file_or_a_missing_folder_is_not_sent_to_the_hub(tmp_path):
    from modeling_deepseek_v41 import DeepseekV41ForCausalLM

    shard = sorted(CHECKPOINT.glob("*.safetensors"))[0]
    with pytest.raises(ValueError, match="is a file; from_pretrained needs the checkpoint folder"):
        DeepseekV41ForCausalLM.from_pretrained(shard)
    with pytest.raises(ValueError, match="checkpoint folder .* does not exist"):
        DeepseekV41ForCausalLM.from_pretrained(tmp_path / "no" / "such" / "folder")


@pytest.mark.parametrize("auto_name", ["AutoModelForCausalLM", "AutoModel", "AutoModelForImageTextToText"])
def test_the_auto_classes_name_a_file_or_a_missing_folder_too(tmp_path, auto_name):
    """transformers resolves the config before any model code runs: the Auto classes would call these an invalid
    hub repository id."""
    import transformers

    auto_class = getattr(transformers, auto_name)
    with pytest.raises(ValueError, match="is a file; from_pretrained needs the checkpoint folder"):
        auto_class.from_pretrained(CHECKPOINT / "config.json")
    for missing in (tmp_path / "no" / "such" / "folder", "./no-such-folder", "no/such/folder"):
        with pytest.raises(ValueError, match="checkpoint folder .* does not exist"):
            auto_class.from_pretrained(missing)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.bfloat16,
                                   torch.float16, torch.float32])
def test_the_finiteness_check_agrees_with_isfinite_on_every_code(dtype):
    from modeling_deepseek_v41.loading.weight_checks import invalid_values

    width = torch.empty(0, dtype=dtype).element_size()
    codes = torch.arange(256, dtype=torch.uint8) if width == 1 else torch.tensor(
        [0, 1, 0x3F80, 0x7F80, 0xFF80, 0x7FC0, 0x7C00, 0xFC00, 0x7E00], dtype=torch.int32)
    for code in codes:
        one = code.reshape(1).to(torch.uint8 if width == 1 else torch.int32)
        value = (one.view(dtype) if width == 1 else (one << 16).view(torch.float32) if width == 4
                 else one.to(torch.int16).view(dtype))
        expected = not bool(torch.isfinite(value.float()).all())
        assert bool(invalid_values(torch.cat([torch.zeros(7, dtype=dtype), value]))) == expected, int(code)
