"""Evaluation of a trained checkpoint: exact-match accuracy on held-out picture questions, and the DSpark
drafter's mean accepted length during greedy generation."""

from __future__ import annotations

import time

import torch

from .data import heldout_questions, python_doc_text


def _prompt_inputs(processor, messages):
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


@torch.no_grad()
def answer(model, processor, messages, max_new_tokens: int = 16, use_dspark: bool = False) -> str:
    """Greedy answer to one chat prompt."""
    inputs = _prompt_inputs(processor, messages)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, use_dspark=use_dspark)
    return processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def image_question_accuracy(model, processor, examples=None, use_dspark: bool = False,
                            return_answers: bool = False):
    """Share of `examples` (default: the fixed held-out set) answered exactly right, e.g. 'A red circle.'"""
    examples = examples if examples is not None else heldout_questions()
    answers = [answer(model, processor, e["messages"], use_dspark=use_dspark) for e in examples]
    accuracy = sum(a == e["answer"] for a, e in zip(answers, examples)) / len(examples)
    return (accuracy, answers) if return_answers else accuracy


def text_prompts(tokenizer, count: int = 8, length: int = 24, seed_offset: int = 7) -> list[torch.Tensor]:
    """Beginnings of Python documentation paragraphs (BOS + `length` tokens) for drafting measurements."""
    paragraphs = [p for p in python_doc_text().split("\n\n") if len(p) > 200]
    step = max(1, len(paragraphs) // count)
    chosen = paragraphs[seed_offset % step::step][:count]
    return [torch.tensor([tokenizer(p)["input_ids"][: length + 1]]) for p in chosen]


@torch.no_grad()
def drafting_stats(model, processor, max_new_tokens: int = 32, n_text: int = 8, n_images: int = 12) -> dict:
    """Mean accepted length (tokens per verification, the backbone's own token included) of greedy generation
    with drafting, on text continuations and on held-out picture answers; also checks the tokens equal those of
    generation without drafting."""
    results = {}
    for kind in ("text", "image"):
        accepted, rounds, same, speed_on, speed_off = 0.0, 0, True, [], []
        if kind == "text":
            prompts = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                       for ids in text_prompts(processor.tokenizer, n_text)]
            new = max_new_tokens
        else:
            prompts = [_prompt_inputs(processor, e["messages"]) for e in heldout_questions()[:n_images]]
            new = 16
        for inputs in prompts:
            plain_stats, stats = {}, {}
            plain = model.generate(**inputs, max_new_tokens=new, do_sample=False, use_dspark=False,
                                   generation_stats=plain_stats)
            speed_off.append(plain_stats["tokens_per_second"])
            drafted = model.generate(**inputs, max_new_tokens=new, do_sample=False, use_dspark=True,
                                     generation_stats=stats)
            speed_on.append(stats["tokens_per_second"])
            accepted += (stats["dspark_mean_accepted_length"] - 1.0) * stats["dspark_rounds"]
            rounds += stats["dspark_rounds"]
            same &= bool(torch.equal(plain, drafted))
        results[kind] = {
            "mean_accepted_length": 1.0 + accepted / max(rounds, 1), "rounds": rounds, "same_tokens": same,
            "tokens_per_second_drafting": sum(speed_on) / len(speed_on),
            "tokens_per_second_plain": sum(speed_off) / len(speed_off),
        }
    return results


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def evaluate_checkpoint(folder, n_heldout: int | None = None) -> dict:
    """Load `folder` through the hub loader (as shipped: quantized weight mode) and measure accuracy and drafting."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    examples = heldout_questions() if n_heldout is None else heldout_questions()[:n_heldout]
    (accuracy, answers), seconds = timed(image_question_accuracy, model, processor, examples, False, True)
    return {
        "weight_mode": model.config.weight_mode,
        "heldout_accuracy": accuracy, "heldout_count": len(examples), "heldout_seconds": seconds,
        "wrong": [(e["answer"], a) for e, a in zip(examples, answers) if a != e["answer"]][:10],
        "drafting": drafting_stats(model, processor),
    }
