"""The project's main job on the trained embedded default: answer a question about a picture with DeepSeek-V4.1
through pipeline("image-text-to-text"), DSpark drafting on, and print the answer and the measured stats.

    python examples/demo.py [--checkpoint DIR] [--max-new-tokens N]

examples/default-checkpoint is a small DeepSeek-V4.1 (CSA2 Full/Reuse/Reindex with candidates, Engram, mHC, MoE,
vision, DSpark) trained by examples/build_default.py on generated pictures of coloured shapes and Python's own
documentation text. It is stored in the hub layout (FP8/FP4) and loads through the real hub loader.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoProcessor, pipeline  # noqa: E402

import modeling_deepseek_v41  # noqa: E402,F401  (registers the model and processor with the Auto classes)
from training.data import MAIN_QUESTION, ShapeSample, draw_shape  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "examples" / "default-checkpoint"


def demo_image():
    """A fixed drawing: a red circle in the middle of a white 126 x 126 picture."""
    return draw_shape(ShapeSample("circle", "red", (63.0, 63.0), 36.0, 0.0, (255, 255, 255)))


def ask(checkpoint: Path, image, question: str, max_new_tokens: int) -> tuple[str, dict]:
    """Load a hub-layout checkpoint, answer `question` about `image` through the pipeline with DSpark drafting,
    and return the answer with the model's measured generation stats."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    processor = AutoProcessor.from_pretrained(checkpoint)
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
    stats = {}
    result = pipe(text=messages, max_new_tokens=max_new_tokens, return_full_text=False,
                  generate_kwargs={"use_dspark": True, "do_sample": False, "generation_stats": stats})
    return result[0]["generated_text"], stats


def print_answer(question: str, answer: str, stats: dict) -> None:
    print(f"question: {question}")
    print(f"answer:   {answer!r}")
    print(f"tokens/s: {stats['tokens_per_second']:.1f} ({stats['new_tokens']} tokens in {stats['seconds']:.2f} s, CPU)")
    print(f"DSpark mean accepted length: {stats['dspark_mean_accepted_length']:.2f} tokens per verification")
    print(f"cache: {stats['cache_global_bytes_per_token']:.0f} bytes of global KV per token")


def build_parser() -> argparse.ArgumentParser:
    summary, _, details = __doc__.partition("\n\n")
    details = details.split("\n\n", 1)[-1]  # the rest, after the usage line
    parser = argparse.ArgumentParser(description=textwrap.fill(" ".join(summary.split()), 100), epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="a DeepSeek-V4.1 checkpoint folder (config.json, weights, tokenizer), in the hub layout "
                             "or saved by save_pretrained (default: the embedded examples/default-checkpoint)")
    parser.add_argument("--max-new-tokens", type=int, default=16,
                        help="the most tokens the answer may have (default: 16)")
    return parser


def check_checkpoint(checkpoint: Path) -> None:
    """Exit with advice that fits the folder asked for: rebuild the embedded default, or fix the given path."""
    if checkpoint.resolve() == DEFAULT_CHECKPOINT.resolve():
        if not (checkpoint / "config.json").exists():
            raise SystemExit(f"The embedded default checkpoint {checkpoint} is missing: run "
                             "`python examples/build_default.py` to rebuild it.")
        return
    if not checkpoint.is_dir():
        what = "is a file, not a folder" if checkpoint.exists() else "does not exist"
        raise SystemExit(f"--checkpoint {checkpoint} {what}: pass the folder of a DeepSeek-V4.1 checkpoint, or leave "
                         "--checkpoint out to use the embedded default.")
    if not (checkpoint / "config.json").exists():
        raise SystemExit(f"--checkpoint {checkpoint} has no config.json, so it is not a checkpoint folder: pass the "
                         "folder that holds config.json, the weights and the tokenizer.")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_checkpoint(args.checkpoint)
    answer, stats = ask(args.checkpoint, demo_image(), MAIN_QUESTION, args.max_new_tokens)
    report = args.checkpoint / "training_report.json"
    if report.exists():  # say how good the small default is, so its answer is read for what it is
        accuracy = json.loads(report.read_text())["evaluation"]["heldout_accuracy"]
        print(f"(this small trained default answers {accuracy:.0%} of its held-out picture questions correctly)")
    print_answer(MAIN_QUESTION, answer, stats)


if __name__ == "__main__":
    main()
