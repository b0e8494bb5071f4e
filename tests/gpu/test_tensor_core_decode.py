"""The tensor-core decode (kernels.triton.use_mma_moe / use_mma_linears: moe_mma.py, fp8_mma.py, dense_mma.py) in a
whole quantized model on CUDA (skipped without one, or without Triton's Gluon), each switch alone and both: a k-token
forward still equals k one-token steps bit for bit, graph-replayed steps equal the eager ones, with PDL as without,
and the logits stay within the fixtures' loose bounds of the CUDA-core formulations'."""

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
    def switched(on=True):
        """The chosen products on the tensor cores and the others not (on=False: none), as it was after."""
        before = mma_choice.mma_moe_enabled(), mma_choice.mma_linears_enabled()
        mma_choice.use_mma_moe(on and "moe" in request.param)
        mma_choice.use_mma_linears(on and "linears" in request.param)
        try:
            yield
        finally:
            mma_choice.use_mma_moe(before[0])
            mma_choice.use_mma_linears(before[1])
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


def test_k_token_forward_equals_single_steps_and_stays_near_the_cuda_core_formulations(mma):
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    model = _quantized_model()
    k = model.config.text_config.dspark_block_size + 1
    ids = _ids(model, 32)
    prompt = ids.shape[1] - k
    with torch.no_grad():
        with mma(on=False):  # the CUDA-core formulations
            cuda_cores = model(input_ids=ids, cache=DeepseekV41Cache(model.config)).logits[0].float()
        with mma():
            full = model(input_ids=ids, cache=DeepseekV41Cache(model.config)).logits[0].float()
            cache = DeepseekV41Cache(model.config)
            model(input_ids=ids[:, :prompt], cache=cache)
            caches = [copy.deepcopy(cache), copy.deepcopy(cache)]
            together = model(input_ids=ids[:, prompt:], cache=caches[0]).logits[0]
            single = torch.cat([model(input_ids=ids[:, t:t + 1], cache=caches[1]).logits[0]
                                for t in range(prompt, ids.shape[1])])
    assert torch.equal(together, single)
    rel = ((full - cuda_cores).norm(dim=-1) / cuda_cores.norm(dim=-1)).median().item()
    top1 = (full.argmax(-1) == cuda_cores.argmax(-1)).float().mean().item()
    print(f"tensor cores against the CUDA cores: median rel. L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= 0.2 and top1 >= 0.7  # the fixtures' loose bounds: fp32 orders re-quantized at every layer


def test_graph_replayed_steps_with_and_without_pdl_equal_the_eager_ones(mma):
    """Static-cache steps replayed from a CUDA graph equal the eager ones, and so do both with programmatic
    dependent launch (the Gluon kernels wait for their inputs as the Triton ones do: mma_common.wait_for_inputs),
    bit for bit."""
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    from modeling_deepseek_v41.kernels.triton import launch
    from modeling_deepseek_v41.model.generation import DeepseekV41CUDAGraphDecoder
    model = _quantized_model()
    ids = _ids(model, 24, seed=1)
    prompt = 12
    with mma(), torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(input_ids=ids[:, :prompt], cache=cache)
        copies = [copy.deepcopy(cache) for _ in range(4)]

        def eager_steps(static):
            static.make_static(ids.shape[1])
            return [model(input_ids=ids[:, t:t + 1], cache=static).logits[0, -1] for t in range(prompt, ids.shape[1])]

        def replayed_steps(static):
            decoder = DeepseekV41CUDAGraphDecoder(model, static, max_new_tokens=ids.shape[1] - prompt)
            steps = [decoder.step(ids[:, t:t + 1])[0, -1] for t in range(prompt, ids.shape[1])]
            decoder.close()
            return steps

        want, graphed = eager_steps(copies[0]), replayed_steps(copies[1])
        launch.use_pdl(True)
        try:
            eager_pdl, graphed_pdl = eager_steps(copies[2]), replayed_steps(copies[3])
        finally:
            launch.use_pdl(False)
    for got in (graphed, eager_pdl, graphed_pdl):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
