"""PEFT the usual way on the embedded default checkpoint: LoRA by the checkpoint's module names, "all-linear",
`PeftModel.from_pretrained`, and adapters trained through Trainer on the frozen FP8/FP4 weights as shipped."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM, AutoProcessor, Trainer, TrainingArguments  # noqa: E402

import modeling_deepseek_v41  # noqa: E402,F401
from modeling_deepseek_v41.layers.linear import DeepseekV41Linear  # noqa: E402
from modeling_deepseek_v41.loading.loader import hub_name  # noqa: E402
from reference_cases import bit_equal  # noqa: E402
from repo_paths import DEFAULT_CHECKPOINT  # noqa: E402

CHECKPOINT = DEFAULT_CHECKPOINT
NAMES = ["wq_a", "wq_b", "wkv", "wo_b", "w1", "w2", "w3"]


def _load(weight_mode="quantized"):
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT, weight_mode=weight_mode)


def _ids(model, seed=0, rows=2, length=20):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.text_config.vocab_size - 16, (rows, length), generator=generator)


def _adapted(peft_model) -> set[str]:
    return {name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")
            and hasattr(module, "base_layer")}


@pytest.mark.parametrize("weight_mode", ["quantized", "bf16"])
def test_lora_by_module_names_adapts_the_projections(weight_mode):
    model = _load(weight_mode)
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, DeepseekV41Linear))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=NAMES, task_type="CAUSAL_LM"))
    adapted = _adapted(peft_model)
    for suffix in ("layers.0.attn.wq_a", "layers.0.attn.wq_b", "layers.0.attn.wkv", "layers.0.attn.wo_b",
                   "layers.0.ffn.experts.0.w1", "layers.0.ffn.experts.0.w2", "layers.0.ffn.shared_experts.w3"):
        assert any(name.endswith(suffix) for name in adapted), suffix
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = _ids(model)
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    grads = [n for n, p in peft_model.named_parameters() if p.grad is not None]
    assert any("layers.0.attn.wq_a.lora_A" in n for n in grads)
    assert any("ffn.experts" in n and "lora_A" in n for n in grads)


def test_all_linear_adapts_the_backbone_not_the_output_head():
    model = _load()
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    adapted = {name.split("base_model.model.", 1)[-1] for name in _adapted(peft_model)}
    head = next(name for name, module in model.named_modules() if module is model.get_output_embeddings()
                or getattr(module, "base_layer", None) is model.get_output_embeddings())
    assert head not in adapted
    assert any(name.endswith("layers.0.attn.wq_a") for name in adapted)
    assert any(name.endswith("layers.0.ffn.experts.0.w2") for name in adapted)
    assert any(name.startswith("model.vision.") for name in adapted)
    assert not any(name.endswith("wo_a") for name in adapted)  # grouped einsum on its weight, not a linear layer
    assert len([n for n in adapted if ".ffn." in n or ".attn." in n]) > 11


def test_checkpoint_tensor_names_are_unchanged():
    model = _load()
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())
    stored = set(index["weight_map"])
    on_disk = {hub_name(n) for n in model.state_dict()}  # what save_pretrained(save_original_format=True) writes
    assert {n for n in stored if ".attn.wo_a." in n} <= on_disk
    assert not {n for n in on_disk if n.endswith(".bias") and n not in stored}


def test_quantized_linear_backward_is_the_dequantized_weights():
    model = _load()
    linear = model.get_submodule("model.layers.0.ffn.experts.0.w1")
    assert linear.storage == "fp4"
    x = torch.randn(5, linear.in_features, requires_grad=True)
    y = linear(x)
    with torch.no_grad():
        assert torch.equal(y, linear(x))  # the same emulation with and without autograd
    y.backward(torch.ones_like(y))
    expected = torch.ones_like(y) @ linear.dense_weight(torch.float32)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert linear.weight.grad is None and linear.scale.grad is None


def _text_dataset(processor, rows=16):
    from training.data import text_examples

    return text_examples(processor.tokenizer, 24)[:rows]


def _args(tmp_path, steps, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=5e-3, use_cpu=True, report_to="none", save_strategy="no",
                             remove_unused_columns=False, logging_steps=1, disable_tqdm=True, **kwargs)


def test_lora_on_the_shipped_fp8_fp4_weights_through_trainer(tmp_path):
    from training.collator import DeepseekV41TrainingCollator

    model = _load()
    assert model.quantized
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=NAMES,
                                                            task_type="CAUSAL_LM"))
    data = _text_dataset(processor)
    trainer = Trainer(model=peft_model, args=_args(tmp_path, 8, gradient_checkpointing=True), train_dataset=data,
                      data_collator=DeepseekV41TrainingCollator(processor))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2]), losses

    base = dict(peft_model.get_base_model().named_parameters())
    for name, value in before.items():
        module, _, leaf = name.rpartition(".")
        now = base[name] if name in base else base[f"{module}.base_layer.{leaf}"]
        assert now.dtype == value.dtype and bit_equal(now, value), name

    peft_model.save_pretrained(tmp_path / "adapter")
    ids = _ids(model, seed=3)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    reloaded = peft.PeftModel.from_pretrained(_load(), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
        assert not torch.equal(_load()(input_ids=ids).logits, expected)  # the adapter changed the answer


def test_trainer_on_a_quantized_model_without_adapters_names_the_ways_out(tmp_path):
    from training.collator import DeepseekV41TrainingCollator

    model = _load()
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    trainer = Trainer(model=model, args=_args(tmp_path, 1), train_dataset=_text_dataset(processor, 4),
                      data_collator=DeepseekV41TrainingCollator(processor))
    with pytest.raises(ValueError, match=r"(?s)adapters.*weight_mode=\"bf16\""):
        trainer.train()


@pytest.mark.parametrize("kind", ["loha", "lokr", "ia3"])
def test_other_adapter_kinds_train_on_the_shipped_weights(kind):
    """Full-rank-capable adapters (LoHa's Hadamard and LoKr's Kronecker products) on the FP8 projections, IA3 on
    every projection: the loss falls and the quantized base stays bit-identical."""
    from training.lora import target_regex

    model = _load()
    fp8_only = target_regex(routed_experts=False)
    config = {
        "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=fp8_only, task_type="CAUSAL_LM"),
        "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=fp8_only, task_type="CAUSAL_LM"),
        "ia3": lambda: peft.IA3Config(target_modules=target_regex(), feedforward_modules=["w2"],
                                      task_type="CAUSAL_LM"),
    }[kind]()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = peft.get_peft_model(model, config)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = _ids(model)
    peft_model.train()
    losses = []
    for _ in range(4):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    base = dict(peft_model.get_base_model().named_parameters())
    for name, value in before.items():
        module, _, leaf = name.rpartition(".")
        now = base[name] if name in base else base[f"{module}.base_layer.{leaf}"]
        assert bit_equal(now, value), name
