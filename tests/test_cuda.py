"""The accelerator paths on a CUDA device (skipped without one): fused softmax and Sinkhorn, the gathered-expert
MoE and the sync-free cache writes of decode steps.

GPU kernels round differently from the reference's CPU ones, and every last-bit difference is re-quantized to FP8
at the next projection, so whole-model logits are held to the loose bounds of the fixtures' README (median
per-position relative L2 <= 0.2, top-1 agreement >= 0.7 on tie-free positions); these catch gross errors.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from reference_cases import load_case, load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEFAULT_CHECKPOINT = ROOT / "examples" / "default-checkpoint"
MAX_MEDIAN_REL_L2 = 0.2
MIN_TOP1 = 0.7


def _agreement(logits: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(median per-position relative L2, top-1 agreement) of [S, V] logits."""
    logits, expected = logits.float().cpu(), expected.float().cpu()
    rel = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    return float(rel.median()), float((logits.argmax(-1) == expected.argmax(-1)).float().mean())


def _cuda_model(case_dir):
    return copy.deepcopy(load_model(case_dir)).cuda()


def _text_decode_case(case_dir):
    """(CUDA model, first row's ids, its tie-free length, the prompt length) of the text case."""
    case = load_case(case_dir)
    if "token_types" in case.inputs:
        pytest.skip("the decode comparison runs on the text case")
    clean = int(case.expected["clean_prefix"][0])
    return _cuda_model(case_dir).eval(), case.inputs["input_ids"][:1].cuda(), clean, clean // 2


def _default_on_cuda():
    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_CHECKPOINT).cuda().eval()
    return model, AutoProcessor.from_pretrained(DEFAULT_CHECKPOINT)


def test_fixture_logits_on_cuda(case_dir):
    case = load_case(case_dir)
    model = _cuda_model(case_dir)
    inputs = {k: v.cuda() for k, v in case.model_inputs().items()}
    with torch.no_grad():
        logits = model(**inputs).logits
    for row, clean in enumerate(int(c) for c in case.expected["clean_prefix"]):
        rel, top1 = _agreement(logits[row, :clean], case.expected["logits"][row, :clean])
        print(f"{Path(case_dir).name} row {row}: median rel L2 {rel:.4f}, top-1 {top1:.3f}")
        assert rel <= MAX_MEDIAN_REL_L2 and top1 >= MIN_TOP1


def test_cached_decode_on_cuda_matches_the_full_forward(case_dir):
    """Token-by-token decode steps (the gathered-expert MoE and sync-free cache writes) against one forward."""
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    model, ids, clean, prompt = _text_decode_case(case_dir)
    with torch.no_grad():
        full = model(input_ids=ids[:, :clean]).logits[0]
        cache = DeepseekV41Cache(model.config)
        steps = [model(input_ids=ids[:, :prompt], cache=cache).logits[0, -1]]
        for t in range(prompt, clean - 1):
            steps.append(model(input_ids=ids[:, t:t + 1], cache=cache).logits[0, -1])
    rel, top1 = _agreement(torch.stack(steps), full[prompt - 1:clean - 1])
    print(f"decode steps {len(steps)}: median rel L2 {rel:.4f}, top-1 {top1:.3f}")
    assert rel <= MAX_MEDIAN_REL_L2 and top1 >= MIN_TOP1


@pytest.mark.skipif(not DEFAULT_CHECKPOINT.exists(), reason="examples/default-checkpoint is not built")
def test_default_checkpoint_on_cuda_answers_and_drafts_losslessly():
    from training.data import heldout_questions

    model, processor = _default_on_cuda()
    examples = heldout_questions()
    right = 0
    for example in examples:
        inputs = processor.apply_chat_template(example["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt").to("cuda")
        plain = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        drafted = model.generate(**inputs, max_new_tokens=16, do_sample=False, use_dspark=True)
        assert torch.equal(plain, drafted)
        answer = processor.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        right += answer == example["answer"]
    from test_default_checkpoint import ACCURACY_THRESHOLD

    print(f"default checkpoint on CUDA: {right}/{len(examples)} held-out answers right")
    assert right / len(examples) >= ACCURACY_THRESHOLD


def test_cuda_graph_decode_replays_the_eager_steps(case_dir):
    """Graph-replayed decode steps give the eager static-cache steps' logits bit for bit, and agree with the
    growing cache's steps (which attend over fewer, unmasked entries)."""
    from modeling_deepseek_v41.cache import DeepseekV41Cache
    from modeling_deepseek_v41.cache.graph_decoder import DeepseekV41CUDAGraphDecoder

    model, ids, clean, prompt = _text_decode_case(case_dir)
    with torch.no_grad():
        growing = DeepseekV41Cache(model.config)
        model(input_ids=ids[:, :prompt], cache=growing)
        static, replayed = copy.deepcopy(growing), copy.deepcopy(growing)
        eager = [model(input_ids=ids[:, t:t + 1], cache=growing).logits[0, -1] for t in range(prompt, clean)]
        static.make_static(clean)
        eager_static = [model(input_ids=ids[:, t:t + 1], cache=static).logits[0, -1] for t in range(prompt, clean)]
    decoder = DeepseekV41CUDAGraphDecoder(model, replayed, max_new_tokens=clean - prompt)
    graphed = [decoder.step(ids[:, t:t + 1])[0, -1] for t in range(prompt, clean)]
    decoder.close()
    assert all(torch.equal(g, s) for g, s in zip(graphed, eager_static))
    rel, top1 = _agreement(torch.stack(graphed), torch.stack(eager))
    print(f"graph-replayed steps {len(graphed)} vs growing cache: median rel L2 {rel:.2e}, top-1 {top1:.3f}")
    assert rel <= MAX_MEDIAN_REL_L2 and top1 >= MIN_TOP1


@pytest.mark.skipif(not DEFAULT_CHECKPOINT.exists(), reason="examples/default-checkpoint is not built")
def test_generate_with_cuda_graphs_gives_the_plain_tokens():
    from training.evaluate import text_prompts

    model, processor = _default_on_cuda()
    for ids in text_prompts(processor.tokenizer, 2):
        ids = ids.cuda()
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        graphed = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 cuda_graphs=True)
        assert torch.equal(plain, graphed)
