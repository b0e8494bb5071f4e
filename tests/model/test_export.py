"""torch.export of a forward: the traced graph reads nothing back from the tensors (the compressor sizes its pools
from the chunk's width, the MoE runs every expert masked) and computes the eager forward's logits. The cache is left
out of an exported program (a Python object that grows with every call): a forward that would return one, because
the config says use_cache, exports without it; asking for it is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from model_factory import random_model, tiny_config


def test_exported_forward_matches_eager_on_a_left_padded_batch():
    model = random_model(tiny_config(), dtype=torch.float32).eval()  # every CSA2 role, Engram layers
    assert model.config.text_config.use_cache  # eager, this forward returns a cache
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        assert model(**inputs).cache is not None
        expected = model(**inputs, use_cache=False).logits
        program = torch.export.export(model, (), inputs, strict=False)
        exported = program.module()(**inputs)
        other = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(12))
        replayed = program.module()(**{**inputs, "input_ids": other}).logits
        fresh = model(**{**inputs, "input_ids": other}, use_cache=False).logits
    assert exported.cache is None
    # the masked MoE multiplies all rows at once: the same products, other fp32 summation blocks in the GEMM
    torch.testing.assert_close(exported.logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(replayed, fresh, rtol=1e-5, atol=1e-5)
    assert torch.equal(exported.logits.argmax(-1), expected.argmax(-1))


def test_export_refuses_to_take_or_return_a_cache():
    model = random_model(tiny_config(), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(13))
    with torch.no_grad(), pytest.raises(ValueError, match="torch.export cannot take or return a DeepseekV41Cache"):
        torch.export.export(model, (), {"input_ids": ids, "use_cache": True}, strict=False)
