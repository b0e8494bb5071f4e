"""DSpark speed-up on the trained default checkpoint: greedy generation with and without drafting, same process.

Run: python benchmarks/dspark_speedup.py [--checkpoint DIR] [--device cuda] [--repeats 3] [--text-prompts 8]
Times whole generate() calls (prefill included), synchronised on CUDA, median of `--repeats` after a warm-up, on
the Python-documentation text prompts and the held-out picture questions of `training.evaluate`. Prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.data import heldout_questions  # noqa: E402
from training.evaluate import text_prompts  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs: dict, new_tokens: int, use_dspark: bool, repeats: int) -> tuple[torch.Tensor, float, dict]:
    """Median seconds of `repeats` greedy generate() calls after one warm-up; returns the output, seconds, stats."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, use_dspark=use_dspark)
    model.generate(**inputs, **kwargs)
    seconds, stats = [], {}
    for _ in range(repeats):
        synchronize(model.device)
        start = time.perf_counter()
        output = model.generate(**inputs, generation_stats=stats, **kwargs)
        synchronize(model.device)
        seconds.append(time.perf_counter() - start)
    return output, statistics.median(seconds), stats


def measure(model, prompts: list[dict], new_tokens: int, repeats: int) -> dict:
    plain_s = draft_s = tokens = accepted = rounds = 0.0
    same = True
    for inputs in prompts:
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        plain, t_plain, _ = timed_generate(model, inputs, new_tokens, False, repeats)
        drafted, t_draft, stats = timed_generate(model, inputs, new_tokens, True, repeats)
        same &= bool(torch.equal(plain, drafted))
        tokens += plain.shape[1] - inputs["input_ids"].shape[1]
        plain_s, draft_s = plain_s + t_plain, draft_s + t_draft
        accepted += (stats["dspark_mean_accepted_length"] - 1.0) * stats["dspark_rounds"]
        rounds += stats["dspark_rounds"]
    return {"prompts": len(prompts), "new_tokens": int(tokens), "plain_tok_s": tokens / plain_s,
            "draft_tok_s": tokens / draft_s, "speedup": plain_s / draft_s,
            "mean_accepted_length": 1.0 + accepted / max(rounds, 1), "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "examples" / "default-checkpoint"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--pictures", type=int, default=12)
    parser.add_argument("--text-prompts", type=int, default=8)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).to(args.device).eval()
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    text = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            for ids in text_prompts(processor.tokenizer, args.text_prompts)]
    pictures = [dict(processor.apply_chat_template(e["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt"))
                for e in heldout_questions()[: args.pictures]]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"checkpoint {args.checkpoint}; {device_name}; torch {torch.__version__}; weight mode "
          f"{model.config.weight_mode}; medians of {args.repeats} after a warm-up")
    print("| prompts | new tokens | plain tok/s | DSpark tok/s | speed-up | mean accepted length | same tokens |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, prompts, new in (("picture answers", pictures, 16), ("text", text, args.text_tokens)):
            r = measure(model, prompts, new, args.repeats)
            print(f"| {r['prompts']} {name} | {r['new_tokens']} | {r['plain_tok_s']:.1f} | {r['draft_tok_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | {r['same_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
