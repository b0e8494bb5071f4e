"""The optimizer recipe: head-wise Muon, the Sinkhorn-balanced update, AdamW, parameter groups, Trainer use."""

from __future__ import annotations

import math

import pytest
import torch

from model_factory import random_model, tiny_config
from training.muon import HeadwiseMuon, muon_step, orthogonalize
from training.optimizer_recipe import (
    DeepseekV41Optimizer,
    RecipeOptimizerFactory,
    build_param_groups,
    create_optimizer,
)
from training.parameter_rules import ADAMW, FROZEN, MUON, ROUTER_BIAS, SINKHORN, parameter_rules
from training.sinkhorn_update import enable_sparse_table_gradients, sinkhorn_balance, sinkhorn_step


@pytest.fixture(scope="module")
def vision_model():
    return random_model(tiny_config(vision=True), dtype=torch.float32)


def svd_orthogonal(blocks: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(blocks.double(), full_matrices=False)
    return (u @ vh).float()


@pytest.mark.parametrize("shape", [(4, 64, 64), (3, 32, 96), (2, 96, 32), (1, 128, 40)])
def test_newton_schulz_matches_svd(shape):
    torch.manual_seed(0)
    blocks = torch.randn(shape) * torch.logspace(-1, 0, shape[-1])  # uneven column scales
    ortho = orthogonalize(blocks)
    assert (ortho - svd_orthogonal(blocks)).abs().max() < 5e-3
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.99 and singular.max() < 1.01


def test_zero_block_stays_zero():
    assert orthogonalize(torch.zeros(2, 8, 16)).abs().max() == 0


def test_headwise_update_is_orthogonal_per_head(vision_model):
    """A query projection's update: every head block has singular values 0.18*sqrt(max(block)) (RMS 0.18), and it
    is not the whole-matrix orthogonalisation."""
    attn = vision_model.model.layers[0].attn
    weight = attn.wq_b.weight.detach().clone()
    rules = parameter_rules(vision_model)
    block = rules["model.layers.0.attn.wq_b.weight"].block_rows
    assert block == attn.head_dim
    torch.manual_seed(1)
    grad = torch.randn_like(weight)
    updated = weight.clone()
    muon_step(updated, grad, {}, lr=1.0, weight_decay=0.0, momentum=0.95, nesterov=True, update_rms=0.18,
              block_rows=block)
    delta = (weight - updated).view(attn.n_heads, block, -1)
    scale = 0.18 * math.sqrt(max(delta.shape[-2:]))
    singular = torch.linalg.svdvals(delta / scale)
    assert singular.min() > 0.99 and singular.max() < 1.01
    assert torch.allclose(delta.pow(2).mean(dim=(-2, -1)).sqrt(), torch.full((attn.n_heads,), 0.18), rtol=1e-2)
    whole = orthogonalize(grad.unsqueeze(0))[0]
    assert not torch.allclose(delta.reshape(whole.shape) / delta.norm(), whole / whole.norm(), atol=1e-2)


def test_headwise_muon_class_equals_recipe_muon_group():
    torch.manual_seed(2)
    a = torch.nn.Parameter(torch.randn(64, 48))
    b = torch.nn.Parameter(a.detach().clone())
    standalone = HeadwiseMuon([a], lr=0.02, block_rows=16)
    recipe = DeepseekV41Optimizer([{"params": [b], "rule": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95,
                                    "nesterov": True, "update_rms": 0.18, "block_rows": 16}])
    for _ in range(3):
        g = torch.randn(64, 48)
        a.grad, b.grad = g.clone(), g.clone()
        standalone.step()
        recipe.step()
    torch.testing.assert_close(a, b)
    assert isinstance(standalone, torch.optim.Optimizer)


def naive_sinkhorn(direction: torch.Tensor, iterations: int, tau: float, eps: float) -> torch.Tensor:
    x = direction.clone()
    norms = x.norm(dim=1)
    x[norms <= tau * norms.mean()] = 0
    for k in range(iterations):
        x = x / (x.norm(dim=1 - k % 2, keepdim=True) + eps)
    return math.sqrt(x.shape[1]) * x


def test_sinkhorn_balanced_update_rms_and_negligible_rows():
    torch.manual_seed(3)
    m, n = 400, 64
    grad = torch.randn(m, n) * (0.1 + torch.rand(m, 1)) * torch.logspace(-1, 1, n)  # uneven rows and columns
    grad[::7] *= 1e-6  # rows whose gradient is negligible
    update = sinkhorn_balance(grad, iterations=11, tau=1e-3, eps=1e-20)
    negligible = torch.zeros(m, dtype=torch.bool)
    negligible[::7] = True
    assert update[negligible].abs().max() == 0
    kept = update[~negligible]
    torch.testing.assert_close(kept.pow(2).mean(dim=1).sqrt(), torch.ones(len(kept)), rtol=1e-5, atol=1e-5)
    column_rms = kept.pow(2).mean(dim=0).sqrt()
    assert (column_rms - 1).abs().max() < 0.02
    torch.testing.assert_close(update, naive_sinkhorn(grad, 11, 1e-3, 1e-20), rtol=1e-4, atol=1e-5)


def test_sinkhorn_step_first_update_and_no_decay():
    torch.manual_seed(4)
    weight = torch.randn(50, 16)
    grad = torch.randn(50, 16)
    updated = weight.clone()
    sinkhorn_step(updated, grad, {}, lr=0.1, beta=0.95, nesterov=True, gamma=0.18, iterations=11, tau=1e-3,
                  eps=1e-20)
    # first step: the Nesterov direction is a multiple of the gradient, and balancing ignores the scale
    expected = weight - 0.18 * 0.1 * sinkhorn_balance(grad)
    torch.testing.assert_close(updated, expected)


def test_sparse_gradient_touches_only_its_rows_of_a_large_table():
    """A 2M-row table, 40 rows looked up: only those rows move and their update equals the dense rule applied to
    the looked-up rows; the gradient stays sparse."""
    rows, dim = 2_000_000, 8
    table = torch.nn.Parameter(torch.zeros(rows, dim))
    ids = torch.randint(0, rows, (4, 10), generator=torch.Generator().manual_seed(5))
    target = torch.randn(4, 10, dim, generator=torch.Generator().manual_seed(6))
    loss = (torch.nn.functional.embedding(ids, table, sparse=True) - target).square().sum()
    loss.backward()
    assert table.grad.is_sparse
    optimizer = DeepseekV41Optimizer([{"params": [table], "rule": "sinkhorn", "lr": 1.0, "weight_decay": 0.0,
                                       "beta": 0.95, "nesterov": True, "gamma": 0.18, "iterations": 11,
                                       "tau": 1e-3, "eps": 1e-20}])
    optimizer.step()
    touched = ids.unique()
    moved = table.detach().abs().sum(dim=1).nonzero().squeeze(1)
    assert torch.equal(moved, touched)
    grad_rows = table.grad.coalesce().values()
    torch.testing.assert_close(table.detach()[touched], -0.18 * sinkhorn_balance(grad_rows))


def test_sparse_path_equals_dense_when_every_row_is_touched():
    torch.manual_seed(7)
    weight = torch.randn(30, 12)
    dense, sparse = weight.clone(), weight.clone()
    state_dense, state_sparse = {}, {}
    kwargs = dict(lr=0.05, beta=0.95, nesterov=True, gamma=0.18, iterations=11, tau=1e-3, eps=1e-20)
    for _ in range(3):
        grad = torch.randn(30, 12)
        sinkhorn_step(dense, grad, state_dense, **kwargs)
        sinkhorn_step(sparse, grad.to_sparse(1), state_sparse, **kwargs)
    torch.testing.assert_close(dense, sparse)


def test_model_engram_tables_with_sparse_gradients():
    model = random_model(tiny_config(), dtype=torch.float32).train()
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        before = model(ids).logits
    assert enable_sparse_table_gradients(model) == len(model.config.text_config.engram_layer_ids)
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.logits, before)
    out.loss.backward()
    tables = [p for n, p in model.named_parameters() if n.endswith("engram.embed.weight")]
    assert tables and all(t.grad.is_sparse for t in tables)
    snapshot = [t.detach().clone() for t in tables]
    create_optimizer(model, lr=1e-3).step()
    for table, old in zip(tables, snapshot):
        moved = (table.detach() != old).any(dim=1)
        touched = torch.zeros_like(moved)
        touched[table.grad.coalesce().indices()[0]] = True
        assert moved.any() and not (moved & ~touched).any()


def test_rules_and_groups_cover_every_parameter_once(vision_model):
    rules = parameter_rules(vision_model)
    named = dict(vision_model.named_parameters())
    assert set(rules) == set(named)
    groups = build_param_groups(vision_model, lr=1e-3)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert len(grouped) == len(set(grouped))
    trainable = {id(p) for p in named.values() if p.requires_grad}
    assert set(grouped) == trainable
    for name, p in named.items():
        if not p.requires_grad:
            assert rules[name].kind in (ROUTER_BIAS, FROZEN)
    kinds = {name: rule.kind for name, rule in rules.items()}
    assert kinds["model.layers.0.ffn.gate.bias_vl"] == ROUTER_BIAS
    for name in ("model.embed.weight", "lm_head.weight", "model.layers.1.engram.embed.weight"):
        assert kinds[name] == SINKHORN
    for name in ("model.layers.1.engram.wkv.weight", "model.aligner.w1.weight", "model.layers.1.attn.wkv.weight",
                 "model.layers.1.attn.indexer.wk.weight", "model.vision.patch_embed.proj.weight",
                 "model.layers.0.ffn.experts.0.w1.weight"):
        assert kinds[name] == MUON and rules[name].block_rows is None
    text = vision_model.config.text_config
    assert rules["model.layers.1.attn.indexer.wq_b.weight"].block_rows == text.index_head_dim
    assert rules["model.layers.0.attn.wo_a.weight"].block_rows == text.o_lora_rank
    assert rules["model.layers.0.attn_norm.weight"] == rules["model.vision.blocks.0.norm1.weight"]
    assert rules["model.layers.0.attn_norm.weight"].kind == ADAMW and rules["model.layers.0.attn_norm.weight"].decay
    for name in ("model.aligner.w1.bias", "model.layers.0.hc_attn_scale", "model.layers.0.hc_attn_base", "model.layers.0.attn.attn_sink"):
        assert kinds[name] == ADAMW and not rules[name].decay
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert by_param[id(named["model.layers.1.engram.embed.weight"])]["lr"] == pytest.approx(5e-3)
    assert by_param[id(named["model.embed.weight"])]["lr"] == pytest.approx(1e-3)
    assert by_param[id(named["model.embed.weight"])]["weight_decay"] == 0.0


def test_trainer_runs_with_the_recipe(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = random_model(tiny_config(), dtype=torch.float32)
    vocab = model.config.text_config.vocab_size
    generator = torch.Generator().manual_seed(9)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (8, 16), generator=generator)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1)
    before = model.model.layers[0].attn.wq_b.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(create_optimizer(model, args), None))
    trainer.train()
    assert not torch.equal(before, model.model.layers[0].attn.wq_b.weight)
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    factory_trainer = Trainer(model=model, args=args, train_dataset=data,
                              optimizer_cls_and_kwargs=(RecipeOptimizerFactory, {"lr": 1e-3}))
    factory_trainer.create_optimizer()
    assert isinstance(factory_trainer.optimizer, DeepseekV41Optimizer)
