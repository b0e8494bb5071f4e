"""Training path: a step lowers the loss, gradient checkpointing gives the same gradients, LoRA trains only its
adapters, the MoE balance loss reaches the gates, and the batched training-time drafter equals the inference
drafter."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from repo_paths import ROOT

sys.path.insert(0, str(ROOT))

from model_factory import random_model, tiny_config  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.model.generation.dspark import dspark_draft  # noqa: E402
from reference_cases import FIXTURES  # noqa: E402
from training.drafter import (  # noqa: E402
    choose_anchors, draftable, drafter_step_loss, dspark_training_logits, freeze_all_but_drafter,
)
from training.lm import moe_balance_loss  # noqa: E402

VISION_CHECKPOINT = FIXTURES / "tiny-vision" / "checkpoint"


def _batch(model, seed=0, batch=2, seq=24):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.text_config.vocab_size - 16, (batch, seq), generator=generator)
    ids[1, -5:] = 2  # the second row is 5 tokens shorter: causal fill, left out of the loss (see the collator)
    labels = ids.masked_fill(ids == 2, -100)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _train(loss_of_step, optimizer, steps: int = 3) -> list[float]:
    """Run `steps` optimizer steps on the loss `loss_of_step()` returns; the losses, in order."""
    losses = []
    for _ in range(steps):
        loss = loss_of_step()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _processor():
    from transformers import AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    return AutoProcessor.from_pretrained(VISION_CHECKPOINT)


def test_training_step_lowers_loss_text_and_image():
    from training.collator import DeepseekV41TrainingCollator
    from training.data import shape_qa_examples

    processor = _processor()
    model = random_model(tiny_config(vision=True), dtype=torch.float32).train()
    examples = shape_qa_examples(2, seed=0) + [{"text": "Beautiful is better than ugly."}]
    batch = DeepseekV41TrainingCollator(processor)(examples)
    assert "pixel_values" in batch and (batch["labels"] != -100).sum() > 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = _train(lambda: model(**batch).loss, optimizer)
    assert losses[-1] < losses[0]
    model(**batch).loss.backward()
    grads_seen = {name.removeprefix("model.").split(".")[0] for name, p in model.named_parameters()
                  if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert {"embed", "layers", "vision", "aligner", "lm_head"} <= grads_seen


def test_every_trainable_module_gets_a_gradient():
    model = random_model(tiny_config(vision=False), dtype=torch.float32).train()
    model(**_batch(model)).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("model.mtp.")
               and (p.grad is None or not bool(p.grad.abs().sum() > 0))]
    # unrouted experts may see no token in a small batch; the indexers only choose entries (a discrete top-k), so
    # the language-model loss gives them no gradient; everything else must get one
    assert [n for n in missing if ".ffn.experts." not in n and ".attn.indexer." not in n] == []


def test_gradient_checkpointing_gives_the_same_gradients():
    model = random_model(tiny_config(vision=False), dtype=torch.float64).train()
    batch = _batch(model)
    model(**batch).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    model(**batch).loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_moe_balance_loss_reaches_the_gates():
    model = random_model(tiny_config(vision=False), dtype=torch.float32).train()
    batch = _batch(model)
    out = model(**batch, output_router_logits=True)
    text = model.config.text_config
    aux = moe_balance_loss(out.router_logits, out.router_experts, text.n_routed_experts, text.scoring_func,
                           batch["attention_mask"])
    assert 0.5 < aux.item() < text.n_routed_experts
    aux.backward()
    assert model.model.layers[0].ffn.gate.weight.grad.abs().sum() > 0
    assert model.model.layers[0].ffn.gate.bias.grad is None  # the routing biases are not trained by gradient


def test_lora_wraps_the_projections_and_trains_only_adapters(tmp_path):
    pytest.importorskip("peft")
    from training.lora import add_lora

    model = random_model(tiny_config(vision=False), dtype=torch.float32).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = add_lora(model, r=4, lora_alpha=8)
    wrapped = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    for suffix in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.experts.0.w1", "ffn.experts.0.w2",
                   "ffn.experts.0.w3", "ffn.shared_experts.w1"):
        assert any(n.endswith(f"layers.0.{suffix}") for n in wrapped), suffix
    assert not any(".compressor." in n or ".indexer." in n or n.split("model.", 1)[-1].startswith("mtp")
                   for n in wrapped)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    batch = _batch(model)
    losses = _train(lambda: peft_model(**batch).loss, optimizer)
    assert losses[-1] < losses[0]
    after = dict(peft_model.get_base_model().named_parameters())
    for name, value in before.items():
        key = name if name in after else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(after[key], value), name
    # saved adapters attach again to a fresh copy of the base model and give the same logits
    from peft import PeftModel

    peft_model.save_pretrained(tmp_path)
    expected = peft_model(input_ids=batch["input_ids"]).logits
    fresh = random_model(tiny_config(vision=False), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path)
    torch.testing.assert_close(reloaded(input_ids=batch["input_ids"]).logits, expected)


def test_masked_padding_gives_finite_gradients():
    model = random_model(tiny_config(vision=False), dtype=torch.float32).train()
    batch = _batch(model)
    batch["attention_mask"] = (batch["input_ids"] != 2).long()
    model(**batch).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_training_drafter_matches_inference_drafter():
    model = random_model(tiny_config(vision=False), dtype=torch.float64)
    text = model.config.text_config
    size = text.dspark_block_size
    ids = torch.randint(3, text.vocab_size - 16, (1, 30), generator=torch.Generator().manual_seed(3))
    full = model(input_ids=ids)
    for anchor in (4, 21):  # inside the first window, and past it (window 16)
        cache = DeepseekV41Cache(model.config, dspark=True)
        with torch.no_grad():
            model(input_ids=ids[:, : anchor + 1], cache=cache)
            forced = iter(ids[0, anchor + 2: anchor + 2 + size].tolist())
            draft = dspark_draft(model, ids[:, anchor + 1], cache,
                                 lambda scores, i: torch.tensor([next(forced)]))
            batch = dspark_training_logits(model, ids, full.dspark_hidden, torch.tensor([[anchor]]),
                                           torch.tensor([[True]]), torch.ones_like(ids, dtype=torch.bool))
        torch.testing.assert_close(batch.logits[0, 0], draft.logits.float()[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.confidence[0, 0], draft.confidence.float()[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(batch.targets[0, 0], ids[0, anchor + 2: anchor + 2 + size])


def test_anchor_choice_respects_text_and_padding():
    ids = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    types = torch.full_like(ids, -1)
    types[0, 2:5] = 1  # an image span
    text = draftable(ids, mask, types)
    anchors, valid = choose_anchors(text, None)
    for row in range(2):
        for p, ok in zip(anchors[row].tolist(), valid[row].tolist()):
            if ok:
                assert text[row, p + 1] and text[row, p + 2]
    assert set(anchors[0][valid[0]].tolist()) == {4, 5, 6, 7}  # 4 is the image end: its taps are fine


def test_drafter_training_moves_only_the_drafter():
    model = random_model(tiny_config(vision=False), dtype=torch.float32).train()
    names = freeze_all_but_drafter(model)
    assert names and all(n.startswith("model.mtp.") for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batch = _batch(model, seq=32)
    losses = []
    for _ in range(4):
        loss, metrics = drafter_step_loss(model, batch, num_anchors=None, pad_token_id=2)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert 0.0 <= metrics["expected_accept"] <= 1.0
    for name, param in model.named_parameters():
        changed = not torch.equal(param, before[name])
        assert changed == (name in names and changed), name
        if not name.startswith("model.mtp."):
            assert not changed, name


def test_trainer_runs_on_text_and_images(tmp_path):
    from transformers import TrainingArguments

    from training.collator import DeepseekV41TrainingCollator
    from training.data import shape_qa_examples
    from training.lm import DeepseekV41Trainer

    processor = _processor()
    model = random_model(tiny_config(vision=True), dtype=torch.float32).train()
    data = shape_qa_examples(4, seed=1) + [{"text": "Simple is better than complex."}] * 2
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3, use_cpu=True,
                             report_to="none", save_strategy="no", remove_unused_columns=False,
                             learning_rate=1e-3, disable_tqdm=True)
    trainer = DeepseekV41Trainer(model=model, args=args, train_dataset=data,
                                 data_collator=DeepseekV41TrainingCollator(processor), moe_aux_loss_coef=1e-2)
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss > 0


def test_trainer_resume_continues_the_uninterrupted_run(tmp_path):
    """Full fine-tuning resumed from checkpoint-3 reloads the trained weights (the checkpoint holds the model's own
    tensor names) and repeats the uninterrupted run's losses."""
    from safetensors import safe_open
    from transformers import Trainer, TrainingArguments

    from model_factory import schedule_config

    config = schedule_config(dict(  # two layers with an Engram table, no drafter: a few seconds per run
        num_hidden_layers=2, compress_ratios=[2, 1], kv_source_layer_ids=[0, 1], index_source_layer_ids=[0, 1],
        candidate_source_layer_id=1, engram_layer_ids=[1], dspark_target_layer_ids=[], num_nextn_predict_layers=0))
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 500, (12, 16), generator=generator)]

    def run(resume: str | None = None) -> list[float]:
        model = random_model(config, dtype=torch.float32).train()
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, save_steps=3, logging_steps=1,
                                 per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True, report_to="none",
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    uninterrupted = run()
    with safe_open(str(tmp_path / "checkpoint-3" / "model.safetensors"), "pt") as saved:
        assert set(saved.keys()) == set(random_model(config).state_dict())
    resumed = run(resume=str(tmp_path / "checkpoint-3"))
    assert len(uninterrupted) == len(resumed) == 6 and resumed[3:] == uninterrupted[3:]


def test_vision_warmup_trains_the_models_own_tower(tmp_path):
    from transformers import TrainingArguments

    from training.vision_warmup import ShapeLabelCollator, ShapeLabelDataset, VisionClassifier, \
        image_tokens_per_picture, warm_up_vision

    processor = _processor()
    model = random_model(tiny_config(vision=True), dtype=torch.float32).train()
    tokens = image_tokens_per_picture(processor.image_processor)
    classifier = VisionClassifier(model.model.vision, model.model.aligner, tokens, model.config.text_config.hidden_size)
    assert classifier.tower is model.model.vision and classifier.aligner is model.model.aligner
    batch = ShapeLabelCollator(processor.image_processor)([ShapeLabelDataset(8, seed=0)[i] for i in range(8)])
    assert batch["image_grids"][:, 2:].prod(-1).eq(tokens).all()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", save_strategy="no", remove_unused_columns=False,
                             learning_rate=1e-3, disable_tqdm=True)
    report = warm_up_vision(model, processor.image_processor, args, seed=0, heldout=8)
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(name.startswith(("model.vision.", "model.aligner.")) for name in moved)
    assert set(report["heldout_accuracy"]) == {"shape", "colour"} and report["train_loss"] > 0


def test_greedy_continuations_are_the_models_own_greedy_output():
    from training.self_distillation import greedy_continuations

    model = random_model(tiny_config(), dtype=torch.float32).train()
    generator = torch.Generator().manual_seed(4)
    examples = [{"input_ids": torch.randint(3, 500, (20,), generator=generator).tolist()} for _ in range(3)]
    out = greedy_continuations(model, examples, prompt_tokens=8, new_tokens=6, batch_size=2)
    assert model.training and len(out) == 3
    for example, continued in zip(examples, out):
        prompt = torch.tensor([example["input_ids"][:8]])
        with torch.no_grad():
            alone = model.eval().generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                          do_sample=False)
        assert continued["input_ids"][:8] == example["input_ids"][:8]
        assert continued["input_ids"] == alone[0].tolist()[:len(continued["input_ids"])]
    with pytest.raises(ValueError, match="prompt_tokens"):
        greedy_continuations(model, [{"input_ids": [5, 6]}], prompt_tokens=8)
