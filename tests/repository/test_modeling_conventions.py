"""transformers conventions of the model classes (issue 17), each as the user's command with its result checked:
the base model and head, the tensor names on disk, resizing, a model built from a config, the forward options."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, AutoModelForCausalLM
from transformers.modeling_outputs import BaseModelOutputWithPast

from model_factory import tiny_config
from modeling_deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Model
from modeling_deepseek_v41.cache.cache import DeepseekV41Cache
from reference_cases import FIXTURES

CHECKPOINT = FIXTURES / "tiny-text" / "checkpoint"


def stored_names(folder) -> set[str]:
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names |= set(handle.keys())
    return names


@pytest.fixture(scope="module")
def bf16_model():
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(0))


def test_base_model_is_named_by_the_prefix_and_the_head_is_lm_head(bf16_model):
    assert bf16_model.base_model_prefix == "model"
    assert isinstance(bf16_model.model, DeepseekV41Model) and bf16_model.base_model is bf16_model.model
    assert bf16_model.get_output_embeddings() is bf16_model.lm_head
    assert bf16_model.get_input_embeddings() is bf16_model.model.embed
    assert {name.split(".")[0] for name in bf16_model.state_dict()} == {"model", "lm_head"}


def test_automodel_loads_the_hub_checkpoint_as_the_base_model(bf16_model, ids):
    base = AutoModel.from_pretrained(CHECKPOINT, weight_mode="bf16")
    assert type(base) is DeepseekV41Model
    out = base(ids, use_cache=False)
    assert isinstance(out, BaseModelOutputWithPast) and out.last_hidden_state.shape == (2, 7, 128)
    with torch.no_grad():  # the base model's hidden states are what the head reads
        assert torch.equal(bf16_model.lm_head(out.last_hidden_state), bf16_model(ids, use_cache=False).logits)


def test_save_pretrained_writes_the_state_dict_names_and_the_hub_names_on_request(tmp_path, ids):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    model.save_pretrained(tmp_path / "native")
    assert stored_names(tmp_path / "native") == set(model.state_dict())
    model.save_pretrained(tmp_path / "hub", save_original_format=True)
    assert stored_names(tmp_path / "hub") == stored_names(CHECKPOINT) | {"engram_token_map"}
    for folder in ("native", "hub"):
        reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_hidden_states_are_the_documented_stream_means(bf16_model, ids):
    out = bf16_model.model(ids, output_hidden_states=True, use_cache=False)
    text = bf16_model.config.text_config
    assert len(out.hidden_states) == len(out.hc_streams) == text.num_hidden_layers + 1
    assert all(s.shape == (2, 7, text.hc_mult, text.hidden_size) for s in out.hc_streams)
    for hidden, streams in zip(out.hidden_states, out.hc_streams):
        assert torch.equal(hidden, streams.mean(dim=2))
    # the embeddings open the list; the taps the drafter reads are stream means of the same states
    assert torch.equal(out.hidden_states[0], bf16_model.model.embed(ids).to(out.hidden_states[0].dtype))
    lm_out = bf16_model(ids, output_hidden_states=True, use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(lm_out.hidden_states, out.hidden_states))


def test_forward_is_deterministic(bf16_model, ids):
    with torch.no_grad():
        first, second = bf16_model(ids, use_cache=False).logits, bf16_model(ids, use_cache=False).logits
    assert torch.equal(first, second)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "auto", torch.bfloat16, torch.float32])
def test_torch_dtype_is_an_alias_of_dtype(dtype):
    by_dtype = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16", dtype=dtype)
    by_torch_dtype = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16", torch_dtype=dtype)
    first, second = dict(by_dtype.named_parameters()), dict(by_torch_dtype.named_parameters())
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert value.dtype == second[name].dtype and torch.equal(value, second[name]), name


def test_resize_token_embeddings_in_bf16_mode(ids):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16")
    before = model(ids, use_cache=False).logits
    model.resize_token_embeddings(520)
    assert model.config.text_config.vocab_size == 520
    assert model.lm_head.weight.shape[0] == 520 and model.model.embed.weight.shape[0] == 520
    assert model.model.engram_token_map.shape == (520,)
    after = model(torch.cat([ids, torch.tensor([[515], [519]])], dim=1), use_cache=False).logits
    assert after.shape[-1] == 520
    assert torch.equal(after[:, :7, :512], before)
    markov = model.model.mtp[-1].markov_head
    assert markov.embed.weight.shape[0] == 520 and markov.head.weight.shape[0] == 520
    # the drafter drafts after a new token and scores new tokens: DSpark stays lossless
    prompt = torch.tensor([[5, 6, 515, 7, 519]])
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False, use_dspark=True), greedy)


def test_resize_token_embeddings_refuses_quantized_weights():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    with pytest.raises(ValueError, match=r'weight_mode="bf16"'):
        model.resize_token_embeddings(520)


@pytest.mark.parametrize("model_class", [DeepseekV41ForCausalLM, DeepseekV41Model])
def test_a_model_built_from_its_config_runs_and_reloads_without_a_tokenizer(tmp_path, ids, model_class):
    """model_class(config), as transformers' common tests and training from scratch build it: the Engram token map
    has its deterministic default (id modulo the compressed vocabulary), is saved with the weights and reloaded."""
    config = tiny_config()
    model = model_class(config).eval()
    token_map = model.base_model.engram_token_map
    assert torch.equal(token_map, torch.arange(token_map.numel()) % config.text_config.engram_compressed_vocab_size)
    assert torch.equal(AutoModel.from_config(config).engram_token_map, token_map)
    with torch.no_grad():
        out = model(ids, use_cache=False)[0]
    model.save_pretrained(tmp_path)  # no tokenizer files: the saved map makes the folder loadable
    assert not (tmp_path / "tokenizer.json").exists()
    reloaded = model_class.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded.base_model.engram_token_map, token_map)
    with torch.no_grad():
        assert torch.equal(reloaded(ids, use_cache=False)[0], out)


def test_the_base_model_resizes_its_token_map_with_its_embeddings(ids):
    base = AutoModel.from_pretrained(CHECKPOINT, weight_mode="bf16")
    built = base.engram_token_map.clone()
    base.resize_token_embeddings(520)
    assert torch.equal(base.engram_token_map[:512], built)  # the tokenizer's map is kept
    assert torch.equal(base.engram_token_map[512:], torch.arange(512, 520) % 420)
    out = base(torch.cat([ids, torch.tensor([[515], [519]])], dim=1), use_cache=False)
    assert out.last_hidden_state.shape[1] == ids.shape[1] + 1


def test_hub_checkpoint_without_map_or_tokenizer_says_it_needs_the_tokenizer(tmp_path):
    for path in CHECKPOINT.iterdir():
        if not path.name.startswith("tokenizer"):
            (tmp_path / path.name).symlink_to(path)
    assert "engram_token_map" not in stored_names(tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_return_dict_false_gives_a_tuple(bf16_model, ids):
    out = bf16_model(ids, return_dict=False, use_cache=False)
    assert isinstance(out, tuple) and torch.equal(out[0], bf16_model(ids, use_cache=False).logits)


def test_config_flags_are_followed(ids):
    config = tiny_config()
    config.text_config.use_cache = False
    config.output_hidden_states = True
    model = AutoModelForCausalLM.from_config(config).eval()
    out = model(ids)
    assert out.cache is None and len(out.hidden_states) == config.text_config.num_hidden_layers + 1
    assert isinstance(model(ids, use_cache=True).cache, DeepseekV41Cache)
    config.text_config.use_cache = True
    assert isinstance(model(ids).cache, DeepseekV41Cache)  # use_cache=None follows the config
    # ... except in a training forward that records gradients: the cache's packed bytes would carry none
    assert model.train()(ids).cache is None
    with torch.no_grad():
        assert isinstance(model(ids).cache, DeepseekV41Cache)


def test_output_attentions_is_refused_clearly(bf16_model, ids):
    with pytest.raises(ValueError, match="never materialises attention maps"):
        bf16_model(ids, output_attentions=True)


def test_inputs_embeds_without_ids_where_no_engram_layer_needs_them(ids):
    model = DeepseekV41ForCausalLM(tiny_config(engram_layer_ids=[], engram_num_embeddings=[]))
    embeds = model.get_input_embeddings()(ids)
    assert torch.equal(model(inputs_embeds=embeds).logits, model(ids, use_cache=False).logits)


def test_inputs_embeds_without_ids_is_refused_with_engram_layers(bf16_model, ids):
    with pytest.raises(ValueError, match="Engram layers"):
        bf16_model(inputs_embeds=bf16_model.get_input_embeddings()(ids))


def test_from_pretrained_from_a_state_dict(bf16_model, ids):
    model = DeepseekV41ForCausalLM.from_pretrained(None, config=bf16_model.config, state_dict=bf16_model.state_dict())
    assert torch.equal(model(ids, use_cache=False).logits, bf16_model(ids, use_cache=False).logits)


def test_to_dict_keeps_engram_storage_but_config_json_does_not():
    config = tiny_config()
    config.engram_storage = "mmap"
    assert config.to_dict()["text_config"]["engram_storage"] == "mmap"
    assert type(config)(**config.to_dict()).engram_storage == "mmap"
    assert "engram_storage" not in json.loads(config.to_json_string())["text_config"]
