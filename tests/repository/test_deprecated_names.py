"""Public names of the last release that were renamed or removed: each still works for one release and says, in a
FutureWarning, what replaces it; the model's own paths (loading, generate, PEFT) never touch them."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling_deepseek_v41  # noqa: F401
from repo_paths import DEFAULT_CHECKPOINT

CHECKPOINT = DEFAULT_CHECKPOINT
DEPRECATED = "deprecated and will be removed in the next release"


def _load():
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT)


def _ids(rows=1, length=8):
    return torch.randint(3, 300, (rows, length), generator=torch.Generator().manual_seed(2))


def _own_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if DEPRECATED in str(w.message)]


def test_last_generation_stats_warns_and_holds_the_calls_stats():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _load()
        stats = {}
        model.generate(_ids(), max_new_tokens=3, do_sample=False, generation_stats=stats)
    assert _own_warnings(caught) == []
    with pytest.warns(FutureWarning, match=r"last_generation_stats is deprecated.*generation_stats=stats"):
        assert model.last_generation_stats == stats and stats["new_tokens"] == 3


def test_mtp_warns_and_is_the_base_models_drafter():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _load()
        model.generate(_ids(), max_new_tokens=3, do_sample=False, use_dspark=True)
        names = [name for name, _ in model.named_modules()]
    assert _own_warnings(caught) == [] and not any(name.startswith("mtp") for name in names)
    with pytest.warns(FutureWarning, match=r"ForCausalLM.mtp is deprecated.*model.model.mtp"):
        assert model.mtp is model.model.mtp


def test_load_lora_warns_and_loads_like_peft(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    from training.lora import add_lora, load_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = add_lora(_load(), r=2)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)  # zero at init: give the adapter an effect to reload
        adapted.save_pretrained(tmp_path / "adapter")
    assert _own_warnings(caught) == []
    with pytest.warns(FutureWarning, match=r"load_lora is deprecated.*peft.PeftModel.from_pretrained"):
        loaded = load_lora(_load(), tmp_path / "adapter")
    assert isinstance(loaded, PeftModel)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, adapted(_ids()).logits)


def test_drafter_methods_of_the_base_model_warn_and_delegate_to_the_drafter():
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    model, ids = _load(), _ids()
    drafter, text = model.dspark, model.config.text_config
    caches = [DeepseekV41Cache(model.config, dspark=True) for _ in range(2)]
    with torch.no_grad():
        taps = [model(ids, cache=cache).dspark_hidden for cache in caches][0]
        with pytest.warns(FutureWarning, match=r"project_taps is deprecated.*model.mtp.project_taps"):
            assert torch.equal(model.model.project_taps(taps), drafter.project_taps(taps))
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        rotation = drafter.rotation(positions)
        other = taps.flip(1)  # rewrite the rings with other taps, through the old and the new name
        with pytest.warns(FutureWarning, match=r"feed_drafter_rings is deprecated.*model.mtp.feed_rings"):
            model.model.feed_drafter_rings(other, positions, rotation, caches[0])
        drafter.feed_rings(other, positions, {drafter.rope_variant: (rotation, None)}, caches[1])
        last = caches[0].lengths - 1
        windows = [cache.drafter_window(stage.spec.layer_id, last, text.sliding_window, taps.dtype)
                   for stage in drafter for cache in caches]
    assert all(torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
               for old, new in zip(windows[0::2], windows[1::2]))
