"""The tensor-core decode (kernels.triton.use_mma_moe / use_mma_linears: moe_mma.py, fp8_mma.py, dense_mma.py) in a
whole quantized model on CUDA (skipped without one, or without Triton's Gluon), each switch alone and both: a k-token
forward still equals k one-token steps bit for bit, graph-replayed steps equal the eager ones, with PDL as without,
and the logits stay within the fixtures' loose bounds of the committed formulations'."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from reference_cases import FIXTURES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=[("moe",), ("linears",), ("moe", "linears")], ids="+".join)
def mma(request):
    """Switches the chosen products onto the tensor cores for the test's `with mma:` blocks."""
    from contextlib import contextmanager

    from modeling_deepseek_v41.kernels.triton import mma_choice
    if not mma_choice.gluon_available():
        pytest.skip("this Triton has no Gluon")

    @contextmanager
    def switched():
        for name in request.param:
            getattr(mma_choice, f"use_mma_{name}")(True)
        try:
            yield
        finally:
            mma_choice.use_mma_moe(False)
            mma_choice.use_mma_linears(False)
    return switched


def _quantized_model():
    """The tiny-text fixture's schedule with FP8/FP4 weights drawn at random, its experts 128 wide: the tensor-core
    decode takes whole 128-column slices, as the released widths are."""
    from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
    raw = json.loads((FIXTURES / "tiny-text" / "checkpoint" / "config.json").read_text())
    raw["text_config"]["moe_intermediate_size"] = 128
    torch.manual_seed(0)
    with torch.device("cuda"):
        return DeepseekV41ForCausalLM(DeepseekV41Config(**raw)).eval()


def _ids(model, length, seed=0):
    vocab = model.config.text_config.vocab_size
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).cuda()


def test_k_token_forward_equals_single_steps_and_stays_near_the_committed_formulations(mma):
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    model = _quantized_model()
    k = model.config.text_config.dspark_block_size + 1
    ids = _ids(model, 32)
    prompt = ids.shape[1] - k
    with torch.no_grad():
        committed = model(input_ids=ids, cache=DeepseekV41Cache(model.config)).logits[0].float()
        with mma():
            full = model(input_ids=ids, cache=DeepseekV41Cache(model.config)).logits[0].float()
            cache = DeepseekV41Cache(model.config)
            model(input_ids=ids[:, :prompt], cache=cache)
            caches = [copy.deepcopy(cache), copy.deepcopy(cache)]
            together = model(input_ids=ids[:, prompt:], cache=caches[0]).logits[0]
            single = torch.cat([model(input_ids=ids[:, t:t + 1], cache=caches[1]).logits[0]
                                for t in range(prompt, ids.shape[1])])
    assert torch.equal(together, single)
    rel = ((full - committed).norm(dim=-1) / committed.norm(dim=-1)).median().item()
    top1 = (full.argmax(-1) == committed.argmax(-1)).float().mean().item()
    print(f"tensor cores against the committed formulations: median rel. L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= 0.2 and top1 >= 0.7  # the fixtures' loose bounds: fp32 orders re-quantized at every layer


def test_graph_replayed_steps_equal_the_eager_ones(mma):
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    from modeling_deepseek_v41.model.generation import DeepseekV41CUDAGraphDecoder
    model = _quantized_model()
    ids = _ids(model, 24, seed=1)
    prompt = 12
    with mma(), torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(input_ids=ids[:, :prompt], cache=cache)
        eager, replayed = copy.deepcopy(cache), copy.deepcopy(cache)
        eager.make_static(ids.shape[1])
        want = [model(input_ids=ids[:, t:t + 1], cache=eager).logits[0, -1] for t in range(prompt, ids.shape[1])]
        decoder = DeepseekV41CUDAGraphDecoder(model, replayed, max_new_tokens=ids.shape[1] - prompt)
        got = [decoder.step(ids[:, t:t + 1])[0, -1] for t in range(prompt, ids.shape[1])]
        decoder.close()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_programmatic_dependent_launch_gives_the_same_steps(mma):
    """The Gluon kernels wait for their inputs as the Triton ones do (mma_common.wait_for_inputs): launched with
    PDL, eager and graph-replayed steps equal the steps without it, bit for bit."""
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    from modeling_deepseek_v41.kernels.triton import launch
    from modeling_deepseek_v41.model.generation import DeepseekV41CUDAGraphDecoder
    model = _quantized_model()
    ids = _ids(model, 20, seed=2)
    prompt = 10
    with mma(), torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(input_ids=ids[:, :prompt], cache=cache)
        plain, eager, replayed = (copy.deepcopy(cache) for _ in range(3))
        plain.make_static(ids.shape[1])
        want = [model(input_ids=ids[:, t:t + 1], cache=plain).logits[0, -1] for t in range(prompt, ids.shape[1])]
        launch.use_pdl(True)
        try:
            eager.make_static(ids.shape[1])
            got = [model(input_ids=ids[:, t:t + 1], cache=eager).logits[0, -1] for t in range(prompt, ids.shape[1])]
            decoder = DeepseekV41CUDAGraphDecoder(model, replayed, max_new_tokens=ids.shape[1] - prompt)
            graphed = [decoder.step(ids[:, t:t + 1])[0, -1] for t in range(prompt, ids.shape[1])]
            decoder.close()
        finally:
            launch.use_pdl(False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(graphed, want))
