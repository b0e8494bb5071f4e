"""torch.export of a forward: the traced graph reads nothing back from the tensors (the compressor sizes its pools
from the chunk's width, the MoE runs every expert masked) and computes the eager forward's logits."""

from __future__ import annotations

import torch

from model_factory import random_model, tiny_config


def test_exported_forward_matches_eager_on_a_left_padded_batch():
    model = random_model(tiny_config(), dtype=torch.float32).eval()  # every CSA2 role, Engram layers
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    with torch.no_grad():
        expected = model(**inputs).logits
        program = torch.export.export(model, (), inputs, strict=False)
        got = program.module()(**inputs).logits
        other = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(12))
        replayed = program.module()(**{**inputs, "input_ids": other}).logits
        fresh = model(**{**inputs, "input_ids": other}).logits
    # the masked MoE multiplies all rows at once: the same products, other fp32 summation blocks in the GEMM
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(replayed, fresh, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
