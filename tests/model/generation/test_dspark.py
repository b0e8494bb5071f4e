"""DSpark drafting: the drafter against the reference, greedy equality, lossless sampling, missing weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from model_factory import random_model, schedule_config
from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.layers.dspark import DeepseekV41DSpark
from modeling_deepseek_v41.model.generation.dspark import dspark_draft, verify_count
from reference_cases import FIXTURES, load_case, load_model


def test_drafter_equals_reference(case_dir):
    """After a P-token prefill and one decode step, the draft (ids, Markov-biased logits, confidence) matches."""
    case, model = load_case(case_dir), load_model(case_dir)
    length = int(case.meta["settings"]["decode_prefill_len"])
    cache = DeepseekV41Cache(model.config, dspark=True)
    with torch.no_grad():
        model(**case.model_inputs(length), cache=cache)
        step = model(case.inputs["decode_token"][:, None], cache=cache).logits[:, -1]
        draft = dspark_draft(model, step.argmax(-1), cache)
    expected_ids = case.expected["dspark.output_ids"]
    assert torch.equal(draft.ids, expected_ids)
    torch.testing.assert_close(draft.confidence, case.expected["dspark.confidence"], atol=1e-5, rtol=0)
    for i in range(draft.logits.shape[1]):  # each draft step conditions on the previous argmax
        same = (draft.ids[:, : i + 1] == expected_ids[:, : i + 1]).all(-1)
        torch.testing.assert_close(draft.logits[same, i], case.expected["dspark.logits"][same, i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_new_tokens", [1, 3, 17, 30])
def test_greedy_with_drafting_equals_greedy_on_the_fixture(case_dir, max_new_tokens):
    case, model = load_case(case_dir), load_model(case_dir)
    kwargs = case.model_inputs(length=40 if "token_types" not in case.inputs else None)
    kwargs = {k: v[:1] if k in ("input_ids", "token_types") else v for k, v in kwargs.items()}
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    plain = model.generate(**kwargs, **common)
    stats = {}
    drafted = model.generate(**kwargs, use_dspark=True, generation_stats=stats, **common)
    assert torch.equal(plain, drafted)
    assert stats["dspark_rounds"] >= 1 or max_new_tokens == 1


def test_greedy_with_drafting_stops_at_eos_mid_draft():
    model = random_model(dtype=torch.float64, seed=11)
    ids = torch.randint(3, 60, (1, 24))
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                           pad_token_id=2)
    eos = int(plain[0, 24 + 6])  # a token the greedy continuation emits mid-way: make it the EOS
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=2,
                  eos_token_id=eos)
    plain = model.generate(ids, **common)
    drafted = model.generate(ids, use_dspark=True, **common)
    assert torch.equal(plain, drafted)
    assert int(plain[0, -1]) == eos and plain.shape[1] <= 24 + 7


def test_greedy_with_drafting_on_random_models():
    model = random_model(dtype=torch.float64, seed=12)
    for seed in range(3):
        torch.manual_seed(seed)
        ids = torch.randint(3, 40, (1, 19 + seed * 7))
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=23, do_sample=False, pad_token_id=2)
        assert torch.equal(model.generate(ids, **common), model.generate(ids, use_dspark=True, **common))


def test_failing_drafts_back_off_to_plain_steps():
    """A random drafter's rounds keep no draft: generate() then takes plain one-token steps between drafting rounds
    (1, 2, 4, ...), with plain greedy's tokens; dspark_min_accepted=0 drafts every round."""
    model = random_model(dtype=torch.float64, seed=12)
    ids = torch.randint(3, 40, (1, 19))
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=2)
    plain = model.generate(ids, **common)
    backing_off, every_round = {}, {}
    assert torch.equal(model.generate(ids, use_dspark=True, generation_stats=backing_off, **common), plain)
    assert torch.equal(model.generate(ids, use_dspark=True, dspark_min_accepted=0, generation_stats=every_round,
                                      **common), plain)
    assert every_round["dspark_plain_steps"] == 0
    assert backing_off["dspark_plain_steps"] > backing_off["dspark_rounds"] >= 1
    assert backing_off["dspark_rounds"] < every_round["dspark_rounds"]
    with pytest.raises(ValueError, match="dspark_min_accepted"):
        model.generate(ids, use_dspark=True, dspark_min_accepted=-1, **common)


def _tiny_vocab_model():
    """A random three-layer model whose vocabulary is small enough to compare whole output distributions; its
    drafter reads all three layers. Seed 14: about 40% of the first drafts are accepted, so both branches of the
    acceptance are sampled often."""
    config = schedule_config(dict(
        vocab_size=24, dspark_noise_token_id=23, engram_compressed_vocab_size=20, num_hidden_layers=3,
        compress_ratios=[0, 2, 1, 0, 0], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2],
        candidate_source_layer_id=2, engram_layer_ids=[1], dspark_target_layer_ids=[0, 1, 2]))
    config.image_token_id = 22
    model = random_model(config, dtype=torch.float64, seed=14)
    with torch.no_grad():  # sharpen the distributions so that drafts are sometimes accepted, sometimes not
        model.lm_head.weight.mul_(3.0)
    model.generation_config.eos_token_id = None  # every sample has two tokens
    return model


def test_sampling_with_drafting_is_lossless():
    """Chi-square test: the first two sampled tokens have the same joint distribution with and without drafting."""
    model = _tiny_vocab_model()
    prompt = torch.tensor([[0, 5, 9, 5, 9, 5]])
    samples = 300

    def histogram(use_dspark: bool) -> torch.Tensor:
        counts = torch.zeros(24 * 24)
        torch.manual_seed(1234 if use_dspark else 4321)
        for _ in range(samples):
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=True,
                                 temperature=1.0, top_k=0, pad_token_id=2, use_dspark=use_dspark)
            counts[int(out[0, 6]) * 24 + int(out[0, 7])] += 1
        return counts

    with_draft, without = histogram(True), histogram(False)
    # exact distribution of the first two tokens, from the model itself
    with torch.no_grad():
        first = model(prompt).logits[0, -1].softmax(-1)
        second = torch.stack([model(torch.cat([prompt, torch.tensor([[t]])], 1)).logits[0, -1].softmax(-1)
                              for t in range(24)])
    expected = (first[:, None] * second).flatten() * samples
    keep = expected >= 5  # pool the rare cells into one bin, as the chi-square test needs
    for observed in (with_draft, without):
        obs = torch.cat([observed[keep], observed[~keep].sum().view(1)])
        exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
        chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
        dof = int(keep.sum())
        # the 0.999 quantile of chi-square with dof degrees of freedom, by the Wilson-Hilferty approximation
        z = 3.09
        limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
        assert chi2 < limit, (chi2, limit, dof)


def test_verify_count_never_looks_at_the_decided_token():
    confidence = torch.tensor([[3.0, 0.0, -3.0, 2.0, 2.0]])
    assert verify_count(confidence, 0.0) == 5
    assert verify_count(confidence, 0.4) == 2  # sigmoid(3) * sigmoid(0) = 0.476 >= 0.4; times sigmoid(-3) < 0.4
    assert verify_count(confidence, 0.99) == 0


def test_missing_drafter_weights_give_a_clear_error(tmp_path):
    target = tmp_path / "no-drafter"
    shutil.copytree(FIXTURES / "tiny-text" / "checkpoint", target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(target / shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, target / shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    model, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not model.has_dspark and not info["missing_keys"]
    ids = torch.tensor([[0, 5, 6, 7]])
    assert model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=2).shape == (1, 6)
    with pytest.raises(ValueError, match="use_dspark=True needs the DSpark drafter's weights"):
        model.generate(ids, max_new_tokens=2, use_dspark=True)


def test_drafter_weights_are_loaded():
    model, info = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-text" / "checkpoint",
                                                       output_loading_info=True)
    assert model.has_dspark and not info["missing_keys"]
    assert model.model.mtp[0].main_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.mtp[-1].markov_head.head.weight.dtype == torch.float32


def test_use_dspark_from_the_checkpoint_generation_config(tmp_path):
    target = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / "tiny-text" / "checkpoint", target)
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1,
                                                              "use_dspark": True}))
    model = AutoModelForCausalLM.from_pretrained(target)
    ids = load_case(str(FIXTURES / "tiny-text")).inputs["input_ids"][:1, :30]
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=2)
    drafted_stats, plain_stats = {}, {}
    drafted = model.generate(ids, generation_stats=drafted_stats, **common)
    assert drafted_stats["dspark_rounds"] >= 1
    plain = model.generate(ids, use_dspark=False, generation_stats=plain_stats, **common)
    assert plain_stats["dspark_rounds"] is None
    assert torch.equal(drafted, plain)


def test_pipeline_with_drafting(tmp_path):
    from transformers import AutoProcessor, pipeline

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-vision" / "checkpoint")
    processor = AutoProcessor.from_pretrained(FIXTURES / "tiny-vision" / "checkpoint")
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    from PIL import Image

    image = Image.open(FIXTURES / "tiny-vision" / "images" / "image0.png")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Shape?"}]}]
    stats = {}
    drafted = pipe(text=messages, max_new_tokens=6, return_full_text=False,
                   generate_kwargs={"use_dspark": True, "do_sample": False, "generation_stats": stats})
    assert stats["dspark_rounds"] >= 1
    plain = pipe(text=messages, max_new_tokens=6, return_full_text=False, generate_kwargs={"do_sample": False})
    assert drafted[0]["generated_text"] == plain[0]["generated_text"]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Name a shape."}]}]
    stats = {}
    answer = pipe(text=text_only, max_new_tokens=4, return_full_text=False,
                  generate_kwargs={"do_sample": False, "generation_stats": stats})
    assert isinstance(answer[0]["generated_text"], str) and stats["new_tokens"] >= 1


def test_the_drafter_module_keeps_the_checkpoints_stage_names():
    """`model.dspark` (a `DeepseekV41DSpark`) is the base model's `mtp`: its parameters keep the checkpoint's
    `mtp.{i}` names, and a slice of it is a plain list of stages."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-text" / "checkpoint")
    drafter = model.dspark
    assert isinstance(drafter, DeepseekV41DSpark) and drafter is model.model.mtp
    stages = {name.split(".")[2] for name in model.state_dict() if name.startswith("model.mtp.")}
    assert stages == {str(i) for i in range(len(drafter))} and len(drafter) > 1
    assert type(drafter[1:]) is torch.nn.ModuleList and list(drafter[1:]) == list(drafter)[1:]
