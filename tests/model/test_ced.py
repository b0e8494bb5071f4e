"""CED prefill modes and the persistent prefix cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from model_factory import RELEASED_WIDTHS, random_model, schedule_config
from modeling_deepseek_v41.cache import DeepseekV41Cache
from modeling_deepseek_v41.layers.hyper_connections import hc_collapse
from reference_cases import load_case, load_model
from repo_paths import ROOT


def _model(seed: int = 3):
    return random_model(dtype=torch.float64, seed=seed)


def test_exact_prefill_equals_full_forward():
    model = _model()
    ids = torch.randint(3, 500, (2, 60))
    with torch.no_grad():
        full = model(ids).logits
        exact = model(ids, cache=DeepseekV41Cache(model.config), prefill_mode="exact").logits
    torch.testing.assert_close(exact, full, rtol=1e-10, atol=1e-10)


def _bounded_by_hand(model, ids: torch.Tensor) -> torch.Tensor:
    """The bounded-replay rule built from the model's pieces without a cache: encoder layers and the decoder's
    pool over every token, then the decoder over the last `sliding_window` tokens as if they started the
    sequence for the windows."""
    text = model.config.text_config
    decoder, replay = model.plan.decoder_start, text.sliding_window
    context = model.model.prepare_context(ids)
    streams = model.model.embed(ids).unsqueeze(2).repeat(1, 1, text.hc_mult, 1)
    pre_mix = torch.zeros(*streams.shape[:3], dtype=streams.dtype)
    pre_mix[..., 0] = 1.0
    for index in range(decoder):
        streams = model.model.apply_engram(index, streams, context)
        streams, pre_mix, _, _ = model.model.layer_step(index, streams, pre_mix, context)
    spec = model.model.layers[decoder].spec
    model.model.layers[decoder].compress_only(streams, pre_mix, context.positions,
                                        context.rotations[(spec.rope_theta, spec.use_yarn)][1], context.share)
    tail = context.tail(replay)
    tail.share.pool_ready.add(decoder)
    tail.share.window_floor = tail.positions[:, 0]
    streams, pre_mix = streams[:, -replay:], pre_mix[:, -replay:]
    for index in range(decoder, len(model.model.layers)):
        streams = model.model.apply_engram(index, streams, tail)
        streams, pre_mix, _, _ = model.model.layer_step(index, streams, pre_mix, tail)
    return model.lm_head(model.model.norm(hc_collapse(streams, pre_mix)))


def test_bounded_replay_equals_the_rule_built_by_hand():
    model = _model(4)
    ids = torch.randint(3, 500, (2, 53))
    with torch.no_grad():
        bounded = model(ids, cache=DeepseekV41Cache(model.config), prefill_mode="bounded_replay").logits
        by_hand = _bounded_by_hand(model, ids)
    assert bounded.shape[1] == model.config.text_config.sliding_window
    torch.testing.assert_close(bounded, by_hand, rtol=1e-10, atol=1e-10)


def test_bounded_replay_then_decoding_continues():
    model = _model(5)
    ids = torch.randint(3, 500, (1, 45))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         pad_token_id=2, prefill_mode="bounded_replay")
    assert out.shape == (1, 51)
    with torch.no_grad():  # a prompt no longer than the window is replayed whole: exactly the exact prefill
        short = ids[:, :16]
        bounded = model(short, cache=DeepseekV41Cache(model.config), prefill_mode="bounded_replay").logits
        torch.testing.assert_close(bounded, model(short).logits, rtol=1e-10, atol=1e-10)


def test_bounded_replay_distance_on_the_fixture(case_dir):
    """Measured, not hidden: bounded replay is an approximation (numbers in docs/ced.md)."""
    case, model = load_case(case_dir), load_model(case_dir)
    kwargs = case.model_inputs()
    with torch.no_grad():
        exact = model(**kwargs).logits[:, -1]
        bounded = model(**kwargs, cache=DeepseekV41Cache(model.config), prefill_mode="bounded_replay").logits[:, -1]
    p, q = exact.softmax(-1), bounded.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    assert bool(torch.isfinite(kl).all()) and float(kl.max()) < 2.0


def test_saved_prefix_keeps_global_kv_and_replays_exactly_within_a_window(tmp_path):
    model = _model(6)
    ids = torch.randint(3, 500, (1, 40))
    with torch.no_grad():
        for prefix in (12, 30):
            cache = DeepseekV41Cache(model.config)
            model(ids[:, :prefix], cache=cache)
            cache.save(tmp_path / "prefix.cache", model)
            restored = DeepseekV41Cache.load(tmp_path / "prefix.cache", model)
            for source, pool in cache.pools.items():
                rows = prefix // pool.ratio
                assert torch.equal(restored.pools[source].kv.codes[:, :rows], pool.kv.codes[:, :rows])
                assert torch.equal(restored.pools[source].keys.scales[:, :rows], pool.keys.scales[:, :rows])
            continued = model(ids[:, prefix:], cache=restored).logits
            for source, pool in cache.pools.items():  # the replay never rewrote the saved rows
                rows = prefix // pool.ratio
                assert torch.equal(restored.pools[source].kv.codes[:, :rows], pool.kv.codes[:, :rows])
            reference = model(ids[:, prefix:], cache=cache).logits
            if prefix <= model.config.text_config.sliding_window:  # the whole prefix is replayed: exact
                torch.testing.assert_close(continued, reference, rtol=1e-10, atol=1e-10)
            assert restored.get_seq_length() == 40


def test_restore_in_another_process(tmp_path):
    model = _model(7)
    ids = torch.randint(3, 500, (1, 50))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(ids[:, :36], cache=cache)
    cache.save(tmp_path / "prefix.cache", model)
    model.save_pretrained(tmp_path / "model")
    torch.save(ids, tmp_path / "ids.pt")
    here = model.generate(ids[:, :44], attention_mask=torch.ones(1, 44, dtype=torch.long),
                          cache=DeepseekV41Cache.load(tmp_path / "prefix.cache", model), max_new_tokens=5,
                          do_sample=False, pad_token_id=2)
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import modeling_deepseek_v41
        from modeling_deepseek_v41.cache import DeepseekV41Cache
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, dtype=torch.float64)
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        cache = DeepseekV41Cache.load({str(tmp_path / "prefix.cache")!r}, model)
        out = model.generate(ids[:, :44], attention_mask=torch.ones(1, 44, dtype=torch.long), cache=cache,
                             max_new_tokens=5, do_sample=False, pad_token_id=2)
        torch.save(out, {str(tmp_path / "out.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "out.pt"), here)


def test_restore_errors_leave_the_file_untouched(tmp_path):
    model = _model(8)
    ids = torch.randint(3, 500, (1, 30))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(ids, cache=cache)
    path = cache.save(tmp_path / "prefix.cache", model)
    original = path.read_bytes()
    with pytest.raises(ValueError, match="saved from another model"):
        DeepseekV41Cache.load(path, _model(9))
    (tmp_path / "truncated.cache").write_bytes(original[: len(original) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        DeepseekV41Cache.load(tmp_path / "truncated.cache", model)
    flipped = bytearray(original)
    flipped[-5] ^= 0xFF
    (tmp_path / "flipped.cache").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="fails its checksum"):
        DeepseekV41Cache.load(tmp_path / "flipped.cache", model)
    with pytest.raises(ValueError, match="does not extend the restored prefix"):
        other = torch.randint(3, 500, (1, 35))
        model.generate(other, cache=DeepseekV41Cache.load(path, model), max_new_tokens=1, pad_token_id=2)
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_bytes_on_disk_per_token_at_released_widths(tmp_path):
    """890 bytes of packed global KV per token, plus the token id (4) and its real-token flag (1)."""
    model = random_model(schedule_config(RELEASED_WIDTHS), dtype=torch.bfloat16, seed=7)
    sizes = {}
    with torch.no_grad():
        for tokens in (200, 600):
            cache = DeepseekV41Cache(model.config)
            model(torch.randint(3, 500, (1, tokens)), cache=cache)
            sizes[tokens] = cache.save(tmp_path / f"{tokens}.cache", model).stat().st_size
    per_token = (sizes[600] - sizes[200]) / 400
    assert abs(per_token - (890 + 4 + 1)) < 0.5  # the header's digits and alignment move a few bytes
    assert sizes[200] - 200 * per_token < 64 * 1024  # the per-file constant: header, checksums, carries
