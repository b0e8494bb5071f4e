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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import modeling_deepseek_v41  # noqa: E402,F401  (registers the model and processor with the Auto classes)
from transformers import AutoModelForCausalLM, AutoProcessor, pipeline  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    if not args.checkpoint.exists():
        raise SystemExit(f"{args.checkpoint} is missing: run `python examples/build_default.py` to rebuild it.")
    answer, stats = ask(args.checkpoint, demo_image(), MAIN_QUESTION, args.max_new_tokens)
    report = args.checkpoint / "training_report.json"
    if report.exists():  # say how good the small default is, so its answer is read for what it is
        accuracy = json.loads(report.read_text())["evaluation"]["heldout_accuracy"]
        print(f"(this small trained default answers {accuracy:.0%} of its held-out picture questions correctly)")
    print_answer(MAIN_QUESTION, answer, stats)

if __name__ == "__main__":
    main()
