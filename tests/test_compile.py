"""torch.compile captures a whole decode step, layer loop included, as one graph (no graph breaks), on the
accelerator formulations (the gathered-expert MoE and sync-free cache writes that CUDA decode steps take).

The CPU normally keeps its exact per-expert paths, so the test forces the accelerator ones (as
the graph-break inventory in docs/performance.md did) and uses Dynamo's eager backend: what is checked is the capture and that
the captured step computes the eager step's logits, not inductor's kernels.
"""

from __future__ import annotations

import torch

from model_factory import random_model, tiny_config

from modeling_deepseek_v41.cache import DeepseekV41Cache


def _decode(model, step, ids: torch.Tensor, prompt: int) -> list[torch.Tensor]:
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], cache=cache)
        return [step(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(prompt, ids.shape[1])]


def test_decode_step_is_one_graph_and_matches_eager(accelerator_paths):
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    eager = _decode(model, model, ids, prompt=34)
    captured = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)  # fullgraph: a break raises
    compiled = _decode(model, captured, ids, prompt=34)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
