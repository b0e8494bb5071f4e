"""Expert balancing: per-modality bias updates, the sequence-level balance loss, and the Trainer callback."""

from __future__ import annotations

import functools

import pytest
import torch

from model_factory import random_model, tiny_config
from reference_cases import FIXTURES
from training.expert_balancing import (
    ExpertBalanceCallback,
    ExpertBalancer,
    expert_counts,
    sequence_balance_loss,
)

SPEED = 0.02  # the recipe's 0.001 is for long runs; a larger step shows the drift within a few batches
STEPS = 25


def unbalanced_vision_model():
    """Text routing pushed toward experts 0-1, image routing toward the last two experts."""
    model = random_model(tiny_config(vision=True), dtype=torch.float32).train()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.ffn.gate
            gate.bias.zero_()
            gate.bias[:2] = 0.3
            gate.bias_vl.zero_()
            gate.bias_vl[-2:] = 0.3
    return model


def gates(model):
    return [layer.ffn.gate for layer in model.model.layers]


@functools.cache
def tiny_vision_processor():
    from transformers import AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    return AutoProcessor.from_pretrained(FIXTURES / "tiny-vision" / "checkpoint")


def picture_batch(rows: int, seed: int) -> dict:
    """The tiny-vision processor's inputs for `rows` noise pictures, each with the same short question (so no
    row is padded): mostly image-span tokens."""
    from PIL import Image

    processor = tiny_vision_processor()
    generator = torch.Generator().manual_seed(seed)
    pictures = [Image.fromarray(torch.randint(0, 256, (48, 48, 3), generator=generator, dtype=torch.uint8).numpy())
                for _ in range(rows)]
    out = processor(images=pictures, text=[f"{processor.image_token} what is it?"] * rows, return_tensors="pt")
    assert bool(out["attention_mask"].all())
    return dict(out)


def run_batches(model, balancer, pictures: bool, steps: int) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.text_config.vocab_size
    history = []
    with torch.no_grad():
        for step in range(steps):
            if pictures:
                model(**picture_batch(4, seed=100 + step))
            else:
                model(torch.randint(0, vocab, (8, 32), generator=generator))
            history.append(balancer.update_biases())
    return history


def mean_of(history, key, window=5):
    return sum(h[key] for h in history[:window]) / window, sum(h[key] for h in history[-window:]) / window


def test_expert_counts_and_padding():
    experts = torch.tensor([[0, 1], [1, 2], [3, 0]])
    assert expert_counts(experts, 4).tolist() == [2, 2, 1, 1]
    assert expert_counts(experts, 4, torch.tensor([True, False, True])).tolist() == [2, 1, 0, 1]


def test_sequence_balance_loss():
    n_experts, top_k, batch, seq = 4, 2, 2, 8
    experts = torch.tensor([[0, 1], [2, 3]]).repeat(batch * seq // 2, 1)
    uniform = sequence_balance_loss(torch.zeros(batch * seq, n_experts), experts, batch, "sqrtsoftplus")
    assert uniform.item() == pytest.approx(1.0)
    logits = torch.tensor([3.0, 3.0, -3.0, -3.0]).repeat(batch * seq, 1).requires_grad_()
    skewed = sequence_balance_loss(logits, torch.tensor([[0, 1]]).repeat(batch * seq, 1), batch, "sqrtsoftplus")
    assert skewed.item() > 1.5
    skewed.backward()
    assert logits.grad.abs().sum() > 0
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(batch * seq, n_experts, generator=generator)
    experts = logits.topk(top_k, dim=-1).indices
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[:, :4] = False  # padding positions do not count
    masked = sequence_balance_loss(logits, experts, batch, "sqrtsoftplus", valid)
    real = valid.reshape(-1)
    torch.testing.assert_close(masked, sequence_balance_loss(logits[real], experts[real], batch, "sqrtsoftplus"))


def test_text_batches_balance_the_text_bias_only():
    model = unbalanced_vision_model()
    frozen_vl = [g.bias_vl.clone() for g in gates(model)]
    balancer = ExpertBalancer(model, update_speed=SPEED).attach()
    history = run_batches(model, balancer, False, STEPS)
    first, last = mean_of(history, "text_max_over_mean_load")
    assert last < first - 0.3, (first, last)
    assert all("image_max_over_mean_load" not in h for h in history)
    for gate, before in zip(gates(model), frozen_vl):
        assert torch.equal(gate.bias_vl, before)
    assert gates(model)[0].bias[:2].max() < 0.3  # the favoured experts were pushed down


def test_image_heavy_batches_move_each_bias_from_its_own_modality():
    model = unbalanced_vision_model()
    balancer = ExpertBalancer(model, update_speed=SPEED).attach()
    batch = picture_batch(4, seed=1)
    image = (batch["token_types"] >= 0).reshape(-1)
    assert 0.5 < image.float().mean() < 1  # mostly image span, some text
    before = [(g.bias.clone(), g.bias_vl.clone()) for g in gates(model)]
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    balancer.update_biases()
    for gate, (bias, bias_vl), experts in zip(gates(model), before, out.router_experts):
        n = gate.weight.shape[0]
        for load, old, new in ((expert_counts(experts, n, ~image), bias, gate.bias),
                               (expert_counts(experts, n, image), bias_vl, gate.bias_vl)):
            torch.testing.assert_close(new - old, SPEED * torch.sign(load.mean() - load))
    history = run_batches(model, balancer, True, STEPS)
    for key in ("text_max_over_mean_load", "image_max_over_mean_load"):
        first, last = mean_of(history, key)
        assert last < first - 0.3, (key, first, last)


def test_eval_forwards_and_padding_are_not_counted():
    model = unbalanced_vision_model()
    balancer = ExpertBalancer(model).attach()
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    with torch.no_grad():
        model.eval()
        model(ids, attention_mask=mask)
        assert all(c.sum() == 0 for c in balancer.text_counts.values())
        model.train()
        model(ids, attention_mask=mask)
    top_k = model.config.text_config.num_experts_per_tok
    counts = balancer.text_counts[id(gates(model)[0])]
    assert counts.sum() == (mask.sum() * top_k).item()
    balancer.detach()
    with torch.no_grad():
        model(ids)
    assert balancer.text_counts[id(gates(model)[0])].sum() == counts.sum()


def test_balance_loss_joins_the_training_loss():
    model = random_model(tiny_config(), dtype=torch.float32).train()
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    plain = model(ids, labels=ids).loss
    balancer = ExpertBalancer(model, balance_loss_weight=1e-4).attach()
    with_balance = model(ids, labels=ids).loss
    assert balancer.last_balance_loss is not None
    torch.testing.assert_close(with_balance, plain + balancer.last_balance_loss)
    assert 0.5e-4 < balancer.last_balance_loss.item() < 10e-4
    with_balance.backward()
    assert model.model.layers[0].ffn.gate.weight.grad.abs().sum() > 0


def test_trainer_callback_moves_biases(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = random_model(tiny_config(), dtype=torch.float32)
    vocab = model.config.text_config.vocab_size
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(4))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True)
    callback = ExpertBalanceCallback()
    before = model.model.layers[0].ffn.gate.bias.clone()
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    moved = model.model.layers[0].ffn.gate.bias - before
    assert moved.abs().max().item() == pytest.approx(2e-3, rel=1e-4)  # two optimizer steps of 0.001
    assert callback.balancer is not None and not callback.balancer._handles
