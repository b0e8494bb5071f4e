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


def _decode(model, step, ids: torch.Tensor, prompt: int, eager_steps: int = 0) -> list[torch.Tensor]:
    """Logits of the one-token steps after a `prompt`-token prefill; the first `eager_steps` run eagerly."""
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], cache=cache)
        # each step's ids a fresh tensor, as generate() passes them (a slice's offset would be guarded on)
        return [(model if t < prompt + eager_steps else step)(input_ids=ids[:, t:t + 1].clone(), cache=cache).logits
                for t in range(prompt, ids.shape[1])]


def test_decode_step_is_one_graph_and_matches_eager(accelerator_paths):
    """Captured from the second step: one that grows the ratio-2 pool inside the graph, then steps that share one
    graph (each capture costs ~30 s on the CPU; the first step's growth of the history would add a third)."""
    model = random_model(tiny_config(), dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    eager = _decode(model, model, ids, prompt=34)
    captured = torch.compile(model, backend="eager", fullgraph=True, dynamic=True)  # fullgraph: a break raises
    compiled = _decode(model, captured, ids, prompt=34, eager_steps=1)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_inductor_compiles_the_model_on_the_cpu_in_both_weight_modes():
    """The default backend (Inductor's C++ kernels) on a one-layer model with a cache, FP8/FP4 weights and Engram:
    no E8M0 tensor reaches a kernel (the scales are decoded by integer shifts). Inductor fuses the bf16 roundings
    away and the FP8 activation QDQ turns last-bit differences into steps, so the bound is the top-1 agreement."""
    import json

    from model_factory import schedule_config
    from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
    from reference_cases import FIXTURES

    bf16 = schedule_config(dict(
        num_hidden_layers=1, compress_ratios=[2], kv_source_layer_ids=[0], index_source_layer_ids=[0],
        candidate_source_layer_id=None, engram_layer_ids=[0], dspark_target_layer_ids=[], num_nextn_predict_layers=0,
        n_routed_experts=4))
    quantization = json.loads((FIXTURES / "tiny-text" / "checkpoint" / "config.json").read_text())["quantization_config"]
    quantized = DeepseekV41Config(text_config=bf16.text_config.to_dict(), quantization_config=quantization,
                                  weight_mode="quantized")
    ids = torch.randint(3, 400, (1, 10), generator=torch.Generator().manual_seed(4))
    for config in (quantized, bf16):
        torch.manual_seed(0)
        model = DeepseekV41ForCausalLM(config).eval()
        with torch.no_grad():
            eager = model(ids).logits
            compiled = torch.compile(model)(ids).logits
        assert torch.isfinite(compiled).all()
        assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9
        assert ((compiled - eager).norm() / eager.norm()) <= 0.1
