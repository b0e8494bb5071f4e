"""DSpark speed-up on the trained default checkpoint: greedy generation with and without drafting, same process.

Run: python benchmarks/dspark_speedup.py [--checkpoint DIR] [--device cuda] [--repeats 3] [--text-prompts 8]
[--pictures 12] (0 skips that row) [--min-accepted 1] (generate()'s dspark_min_accepted; 0 drafts every round)
Times whole generate() calls (prefill included), synchronised on CUDA, median of `--repeats` after a warm-up, and
the same calls for one new token (prefill and first token: the "after the first token" columns subtract them), on
the Python-documentation text prompts and the held-out picture questions of `training.evaluate`; on CUDA also both
with `cuda_graphs=True` (the warm-up call records, the timed calls replay). Prints markdown.
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


def timed_generate(model, inputs: dict, new_tokens: int, use_dspark: bool, repeats: int, cuda_graphs: bool = False,
                   min_accepted: float | None = None) -> tuple[torch.Tensor, float, dict]:
    """Median seconds of `repeats` greedy generate() calls after one warm-up (with cuda_graphs, the warm-up
    records and the timed calls replay); returns the output, seconds, stats."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, use_dspark=use_dspark)
    if use_dspark and min_accepted is not None:
        kwargs["dspark_min_accepted"] = min_accepted
    if cuda_graphs:
        kwargs["cuda_graphs"] = True
    model.generate(**inputs, **kwargs)
    seconds, stats = [], {}
    for _ in range(repeats):
        synchronize(model.device)
        start = time.perf_counter()
        output = model.generate(**inputs, generation_stats=stats, **kwargs)
        synchronize(model.device)
        seconds.append(time.perf_counter() - start)
    return output, statistics.median(seconds), stats


def measure(model, prompts: list[dict], new_tokens: int, repeats: int, graphs: bool,
            min_accepted: float | None = None) -> dict:
    """Seconds of plain and drafting generation (and with `graphs`, both replayed from CUDA graphs), summed over
    the prompts; whether every variant gave plain greedy's tokens."""
    variants = [("plain", False, False), ("draft", True, False)]
    if graphs:
        variants += [("plain_graphs", False, True), ("draft_graphs", True, True)]
    seconds = dict.fromkeys((name for name, _, _ in variants), 0.0)
    first = dict.fromkeys(seconds, 0.0)  # the prefill and first token alone: what drafting cannot speed up
    tokens = accepted = rounds = recorded = 0.0
    same = True
    for inputs in prompts:
        inputs = {k: v.to(model.device) for k, v in inputs.items()}
        outputs = {}
        for name, use_dspark, cuda_graphs in variants:
            outputs[name], t, stats = timed_generate(model, inputs, new_tokens, use_dspark, repeats, cuda_graphs,
                                                     min_accepted)
            seconds[name] += t
            first[name] += timed_generate(model, inputs, 1, use_dspark, repeats, cuda_graphs, min_accepted)[1]
            if name == "draft":
                accepted += (stats["dspark_mean_accepted_length"] - 1.0) * stats["dspark_rounds"]
                rounds += stats["dspark_rounds"]
            if cuda_graphs:
                recorded += stats["cuda_graphs_recorded"]
        same &= all(torch.equal(outputs["plain"], out) for out in outputs.values())
        tokens += outputs["plain"].shape[1] - inputs["input_ids"].shape[1]
    result = {"prompts": len(prompts), "new_tokens": int(tokens), "same_tokens": same,
              "mean_accepted_length": 1.0 + accepted / max(rounds, 1), "recorded_in_timed_calls": int(recorded)}
    result.update({f"{name}_tok_s": tokens / t for name, t in seconds.items()})
    result["speedup"] = seconds["plain"] / seconds["draft"]
    decode = {name: max(seconds[name] - first[name], 1e-9) for name in seconds}  # the tokens after the first
    result["decode_speedup"] = decode["plain"] / decode["draft"]
    if graphs:
        result["graphs_speedup"] = seconds["plain_graphs"] / seconds["draft_graphs"]
        result["graphs_decode_speedup"] = decode["plain_graphs"] / decode["draft_graphs"]
        result["plain_graphs_decode_tok_s"] = (tokens - len(prompts)) / decode["plain_graphs"]
        result["draft_graphs_decode_tok_s"] = (tokens - len(prompts)) / decode["draft_graphs"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "examples" / "default-checkpoint"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--pictures", type=int, default=12)
    parser.add_argument("--text-prompts", type=int, default=8)
    parser.add_argument("--min-accepted", type=float, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).to(args.device).eval()
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    text = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            for ids in (text_prompts(processor.tokenizer, args.text_prompts) if args.text_prompts else [])]
    pictures = [dict(processor.apply_chat_template(e["messages"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt"))
                for e in heldout_questions()[: args.pictures]]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"checkpoint {args.checkpoint}; {device_name}; torch {torch.__version__}; weight mode "
          f"{model.config.weight_mode}; medians of {args.repeats} after a warm-up")
    graphs = model.device.type == "cuda"
    header = "| prompts | new tokens | plain tok/s | DSpark tok/s | speed-up | after the first token |"
    if graphs:
        header += (" plain, CUDA graphs tok/s | DSpark, CUDA graphs tok/s | speed-up with graphs | after the first "
                   "token: plain / DSpark tok/s, speed-up | graphs recorded in timed calls |")
    print(header + " mean accepted length | same tokens |")
    print("|---" * (header.count("|") + 1) + "|")
    with torch.no_grad():
        for name, prompts, new in (("picture answers", pictures, 16), ("text", text, args.text_tokens)):
            if not prompts:  # --pictures 0 or --text-prompts 0: that row is skipped
                continue
            r = measure(model, prompts, new, args.repeats, graphs, args.min_accepted)
            line = (f"| {r['prompts']} {name} | {r['new_tokens']} | {r['plain_tok_s']:.1f} | {r['draft_tok_s']:.1f} | "
                    f"{r['speedup']:.2f}x | {r['decode_speedup']:.2f}x |")
            if graphs:
                line += (f" {r['plain_graphs_tok_s']:.1f} | {r['draft_graphs_tok_s']:.1f} | {r['graphs_speedup']:.2f}x | "
                         f"{r['plain_graphs_decode_tok_s']:.1f} / {r['draft_graphs_decode_tok_s']:.1f}, "
                         f"{r['graphs_decode_speedup']:.2f}x | {r['recorded_in_timed_calls']} |")
            print(line + f" {r['mean_accepted_length']:.2f} | {r['same_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
