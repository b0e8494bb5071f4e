"""The ViT and the aligner against the reference outputs of the tiny-vision fixture (bit-exact on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modeling_deepseek_v41.config.configuration_deepseek_v41 import DeepseekV41VisionConfig
from modeling_deepseek_v41.layers.vision import DeepseekV41VisionAligner, DeepseekV41VisionTower
from modeling_deepseek_v41.layers.vision_embedding import embed_images, merge_image_embeddings
from repo_paths import FIXTURES

FIXTURE = FIXTURES / "tiny-vision"
CHECKPOINT = FIXTURE / "checkpoint"


def _checkpoint_tensors(prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    weight_map = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted({file for key, file in weight_map.items() if key.startswith(prefixes)}):
        with safe_open(CHECKPOINT / shard, framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    tensors[key] = f.get_tensor(key)
    return tensors


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    state = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
    # strict: every parameter has a checkpoint tensor of the same name and shape; copy_ upcasts the
    # bf16-stored norms into their fp32 parameters exactly
    module.load_state_dict(state, strict=True)


@pytest.fixture(scope="module")
def case():
    config = json.loads((CHECKPOINT / "config.json").read_text())
    meta = json.loads((FIXTURE / "meta.json").read_text())
    vision_config = DeepseekV41VisionConfig(**config["vision_config"])
    tower = DeepseekV41VisionTower(vision_config)
    aligner = DeepseekV41VisionAligner(vision_config, config["text_config"]["hidden_size"])
    tensors = _checkpoint_tensors(("vision.", "aligner.", "image_"))
    _load(tower, tensors, "vision.")
    _load(aligner, tensors, "aligner.")
    return {
        "meta": meta, "tower": tower, "aligner": aligner, "tensors": tensors,
        "inputs": load_file(FIXTURE / "inputs.safetensors"),
        "expected": load_file(FIXTURE / "expected.safetensors"),
    }


def test_parameter_names_and_dtypes(case):
    tower, aligner = case["tower"], case["aligner"]
    names = {f"vision.{k}" for k in tower.state_dict()} | {f"aligner.{k}" for k in aligner.state_dict()}
    assert names == {k for k in case["tensors"] if not k.startswith("image_")}
    for name, param in tower.named_parameters():
        assert param.dtype == (torch.float32 if "norm" in name else torch.bfloat16), name
    assert all(p.dtype == torch.bfloat16 for p in aligner.parameters())


def test_vit_and_aligner_bit_exact(case):
    tower, aligner, expected = case["tower"], case["aligner"], case["expected"]
    with torch.no_grad():
        for i, image in enumerate(case["meta"]["images"]):
            n_vit_h, n_vit_w = image["n_vit_h"], image["n_vit_w"]
            vit = tower(case["inputs"][f"pixel_values.image{i}"], n_vit_h, n_vit_w)
            assert vit.dtype == torch.bfloat16
            assert torch.equal(vit, expected[f"vit_output.image{i}"])
            aligned = aligner(vit, n_vit_h, n_vit_w)
            assert aligned.shape == (image["n_llm_h"] * image["n_llm_w"], aligned.shape[-1])
            assert torch.equal(aligned, expected[f"aligner_output.image{i}"])


def test_result_does_not_depend_on_a_float32_default_dtype(case):
    """Parameters carry the reference's dtypes whatever the default dtype, except that a float64 default builds a
    float64 tower (the exact-semantics mode)."""
    config = DeepseekV41VisionConfig(**json.loads((CHECKPOINT / "config.json").read_text())["vision_config"])
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        tower = DeepseekV41VisionTower(config)
        torch.set_default_dtype(torch.float64)
        assert DeepseekV41VisionTower(config).blocks[0].attn.wqkv.weight.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert tower.blocks[0].attn.wqkv.weight.dtype == torch.bfloat16 and tower.norm.weight.dtype == torch.float32
    _load(tower, case["tensors"], "vision.")
    image = case["meta"]["images"][0]
    with torch.no_grad():
        vit = tower(case["inputs"]["pixel_values.image0"], image["n_vit_h"], image["n_vit_w"])
    assert torch.equal(vit, case["expected"]["vit_output.image0"])


def test_float64_runs_close_to_bf16(case):
    tower = DeepseekV41VisionTower(case["tower"].config)
    tower.load_state_dict(case["tower"].state_dict())
    tower.to(torch.float64)
    image = case["meta"]["images"][0]
    with torch.no_grad():
        vit = tower(case["inputs"]["pixel_values.image0"].double(), image["n_vit_h"], image["n_vit_w"])
    assert vit.dtype == torch.float64
    reference = case["expected"]["vit_output.image0"].double()
    assert (vit - reference).norm() / reference.norm() < 0.05


def test_embed_and_merge_into_the_sequence(case):
    meta, inputs, expected = case["meta"], case["inputs"], case["expected"]
    grids = torch.tensor([[im["n_vit_h"], im["n_vit_w"], im["n_llm_h"], im["n_llm_w"]] for im in meta["images"]])
    pixel_values = torch.cat([inputs[f"pixel_values.image{i}"] for i in range(len(meta["images"]))])
    with torch.no_grad():
        image_embeds = embed_images(case["tower"], case["aligner"], pixel_values, grids)
    aligned = torch.cat([expected[f"aligner_output.image{i}"] for i in range(len(meta["images"]))])
    assert torch.equal(image_embeds, aligned)

    token_types = inputs["token_types"]
    hidden = aligned.shape[-1]
    text_embeds = torch.zeros(*token_types.shape, hidden, dtype=torch.bfloat16)
    tensors = case["tensors"]
    merged = merge_image_embeddings(
        text_embeds, token_types, image_embeds, tensors["image_start"], tensors["image_newline"], tensors["image_end"]
    )
    assert torch.equal(merged[token_types == 1], aligned)
    assert torch.equal(merged[token_types == 0], tensors["image_start"].expand(int((token_types == 0).sum()), -1))
    assert torch.equal(merged[token_types == 3], tensors["image_end"].expand(int((token_types == 3).sum()), -1))
    assert torch.equal(merged[token_types == -1], text_embeds[token_types == -1])
    with pytest.raises(ValueError, match="image slots"):
        merge_image_embeddings(text_embeds, token_types, image_embeds[1:], *(tensors[k] for k in
                               ("image_start", "image_newline", "image_end")))
