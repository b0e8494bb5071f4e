"""Loading the hub checkpoint as shipped: both weight modes, the Engram token map, and every loading error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import modeling_deepseek_v41
from modeling_deepseek_v41 import DeepseekV41ForCausalLM
from reference_cases import FIXTURES, load_case

CHECKPOINT = FIXTURES / "tiny-text" / "checkpoint"


@pytest.fixture
def checkpoint_copy(tmp_path):
    target = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, target)
    return target


def _edit_shard(folder, edit):
    """Apply `edit(tensors)` to the first shard and rewrite it (and the index) in place."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(folder / shard)
    edit(tensors)
    save_file(tensors, folder / shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index))


def test_loads_as_shipped_without_missing_or_unexpected_keys():
    model, info = AutoModelForCausalLM.from_pretrained(CHECKPOINT, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.model.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[1].ffn.experts[0].w1.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.float32
    assert bool((model.model.engram_token_map >= 0).all())


def test_bf16_weight_mode_dequantizes_exactly():
    quantized = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    dense = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode="bf16")
    assert dense.config.weight_mode == "bf16" and dense.config.checkpoint_quantization is None
    assert dense.model.layers[1].attn.wq_a.weight.dtype == torch.bfloat16 and dense.model.layers[1].attn.wq_a.scale is None
    assert torch.equal(dense.model.layers[1].attn.wq_a.weight.float(), quantized.model.layers[1].attn.wq_a.dense_weight())
    assert torch.equal(dense.model.layers[1].ffn.experts[3].w2.weight.float(),
                       quantized.model.layers[1].ffn.experts[3].w2.dense_weight())
    ids = load_case(str(FIXTURES / "tiny-text")).inputs["input_ids"]
    with torch.no_grad():
        logits = dense(ids).logits
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_save_pretrained_round_trip_keeps_logits(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "tokenizer.json").exists()  # the token map travels with the weights
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.model.engram_token_map, model.model.engram_token_map)
    ids = load_case(str(FIXTURES / "tiny-text")).inputs["input_ids"][:, :40]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def _stored(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def test_load_state_dict_takes_the_saved_folder_and_the_hub_names(tmp_path):
    """save_pretrained writes the names of state_dict(), so a plain load_state_dict reads the file (as Trainer's
    resume does); a state dict in the hub's names (the released files) loads too, all but the token map it lacks."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    model.save_pretrained(tmp_path)
    saved, expected = _stored(tmp_path), model.state_dict()
    assert set(saved) == set(expected)
    for state_dict, missing in ((saved, set()), (_stored(CHECKPOINT), {"model.engram_token_map"})):
        fresh = DeepseekV41ForCausalLM(model.config)
        result = fresh.load_state_dict(state_dict, strict=False)
        assert set(result.missing_keys) == missing and not result.unexpected_keys
        loaded = fresh.state_dict()
        assert all(torch.equal(loaded[n].view(torch.uint8), expected[n].view(torch.uint8))
                   for n in expected if n not in missing)


@pytest.mark.parametrize("weight_mode", ["quantized", "bf16"])
def test_accelerate_loads_a_save_pretrained_folder_into_empty_weights(tmp_path, weight_mode):
    """accelerate's big-model path (a model built on the meta device, then load_checkpoint_and_dispatch) matches
    the folder's tensors to the model's by name: it gives from_pretrained's logits."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig

    reference = AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode=weight_mode)
    reference.save_pretrained(tmp_path)
    with init_empty_weights():
        empty = DeepseekV41ForCausalLM(AutoConfig.from_pretrained(tmp_path))
    model = load_checkpoint_and_dispatch(empty, str(tmp_path), device_map="auto",
                                         no_split_module_classes=empty._no_split_modules)
    ids = load_case(str(FIXTURES / "tiny-text")).inputs["input_ids"][:, :40]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_module_named_save_keeps_the_drafter(tmp_path):
    """save_pretrained(save_original_format=False) keeps the module names (model.mtp.*): the drafter loads back."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    assert model.has_dspark
    model.save_pretrained(tmp_path / "saved", save_original_format=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert reloaded.has_dspark
    ids = load_case(str(FIXTURES / "tiny-text")).inputs["input_ids"][:, :40]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_missing_tensor_is_named(checkpoint_copy):
    _edit_shard(checkpoint_copy, lambda t: t.pop(sorted(k for k in t if k.endswith("wq_a.weight"))[0]))
    with pytest.raises(ValueError, match=r"1 missing tensor\(s\): layers\.\d+\.attn\.wq_a\.weight"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_extra_tensor_is_named(checkpoint_copy):
    _edit_shard(checkpoint_copy, lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\): layers\.0\.attn\.bogus\.weight"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_wrong_shape_is_named(checkpoint_copy):
    def shrink(tensors):
        name = sorted(k for k in tensors if k.endswith("kv_norm.weight"))[0]
        tensors[name] = tensors[name][:-1].clone()
    _edit_shard(checkpoint_copy, shrink)
    with pytest.raises(ValueError, match=r"mis-shaped tensor\(s\): layers\.\d+\.attn\.kv_norm\.weight: shape"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_truncated_and_missing_shards_are_named(checkpoint_copy):
    shard = sorted(checkpoint_copy.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{shard.name} is truncated"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)
    shard.unlink()
    with pytest.raises(ValueError, match=f"missing from .*{shard.name}"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_missing_tokenizer_for_token_map(checkpoint_copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint_copy / name).unlink()
    with pytest.raises(ValueError, match="carries no Engram token map.*no tokenizer could be loaded"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_tokenizer_of_another_model_is_rejected(checkpoint_copy):
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] += 1
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="compresses to 420 Engram ids but the config's engram_compressed_vocab"):
        AutoModelForCausalLM.from_pretrained(checkpoint_copy)


def test_sequence_beyond_max_positions_is_rejected():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
    model.config.text_config.max_position_embeddings = 8
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("extra", [{}, {"weight_mode": "bf16"}, {"engram_storage": "mmap"}])
def test_from_pretrained_builds_the_model_once(monkeypatch, extra):
    """One from_pretrained path: the checkpoint is checked against the model transformers builds, not a second
    one built for the check (nor a third for placement on one device)."""
    built = []
    original = modeling_deepseek_v41.DeepseekV41ForCausalLM.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_deepseek_v41.DeepseekV41ForCausalLM, "__init__", counting)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, **extra)
    assert built == ["DeepseekV41ForCausalLM"]
    assert model.config.weight_mode == extra.get("weight_mode", "quantized")


def test_from_pretrained_runs_the_pipeline_steps_in_order(monkeypatch):
    """from_pretrained is the loading pipeline: every step once, in the order its module documents."""
    from modeling_deepseek_v41.loading import pipeline

    names = [step.__name__ for step in pipeline.STEPS]
    documented = [pipeline.__doc__.index(f"{i}. {name} ") for i, name in enumerate(names, start=1)]
    assert documented == sorted(documented)
    ran = []

    def recording(step):
        def run(request):
            ran.append(step.__name__)
            step(request)
        return run

    monkeypatch.setattr(pipeline, "STEPS", tuple(recording(step) for step in pipeline.STEPS))
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, engram_storage="mmap")
    assert ran == names
    assert model.model.layers[1].engram.embed.external is not None  # attached by its step
