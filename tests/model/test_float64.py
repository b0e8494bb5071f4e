"""The model runs in float64 (random weights): the exact-semantics mode later tests compare in."""

from __future__ import annotations

import torch

from model_factory import random_model, tiny_config


def test_float64_forward_is_finite_and_float64():
    model = random_model(dtype=torch.float64)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 40))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float64 and bool(torch.isfinite(out.logits).all())
    assert all(h.dtype == torch.float64 for h in out.hidden_states)
    assert float(out.logits.std()) > 1e-3


def test_float64_forward_is_causal():
    """Logits of a prefix do not change when the sequence is extended: no position sees the future."""
    model = random_model(dtype=torch.float64, seed=1)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 45))
    with torch.no_grad():
        full = model(ids).logits
        for cut in (1, 2, 7, 16, 17, 33):
            torch.testing.assert_close(model(ids[:, :cut]).logits, full[:, :cut], rtol=1e-9, atol=1e-9)


def test_left_padding_matches_unpadded_rows():
    model = random_model(dtype=torch.float64, seed=2)
    vocab = model.config.text_config.vocab_size
    short, long = torch.randint(3, vocab, (1, 21)), torch.randint(3, vocab, (1, 30))
    padded = torch.cat([torch.full((1, 9), 2), short], dim=1)
    batch = torch.cat([padded, long])
    mask = torch.ones_like(batch)
    mask[0, :9] = 0
    with torch.no_grad():
        together = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(together[0, 9:], model(short).logits[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(together[1], model(long).logits[0], rtol=1e-9, atol=1e-9)


def test_loss_and_router_logits():
    model = random_model(dtype=torch.float64, seed=3)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 12))
    out = model(ids, labels=ids, output_router_logits=True)
    assert out.loss.ndim == 0 and bool(torch.isfinite(out.loss))
    text = model.config.text_config
    assert len(out.router_logits) == text.num_hidden_layers
    assert out.router_logits[0].shape == (2 * 12, text.n_routed_experts)
    out.loss.backward()
    assert model.model.layers[1].attn.wq_a.weight.grad is not None


def test_bf16_weight_mode_random_model_runs():
    model = random_model(tiny_config(), dtype=torch.float64).to(torch.bfloat16)
    for module in model.modules():  # the reference keeps these in fp32
        if hasattr(module, "storage") and module.weight.dtype == torch.bfloat16 and module.out_features == 1:
            module.float()
    ids = torch.randint(0, model.config.text_config.vocab_size, (1, 20))
    with torch.no_grad():
        assert bool(torch.isfinite(model(ids).logits).all())
