"""The demo on a RANDOM-WEIGHT checkpoint: the same pipeline("image-text-to-text") call with DSpark drafting as
examples/demo.py, on a small checkpoint this script writes in the hub layout (examples/random-checkpoint).

    python examples/demo_random_weights.py [--checkpoint DIR] [--max-new-tokens N]

Every mechanism runs (CSA2 pools, Engram, mHC, MoE, vision, DSpark, the packed cache) through the real hub loader,
but the answer is noise because the weights are random. Useful with `--checkpoint` for any hub-layout folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import modeling_deepseek_v41  # noqa: E402,F401  (registers the model and processor with the Auto classes)
from conversion_scripts.make_random_checkpoint import make_random_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM, AutoProcessor, pipeline  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "examples" / "random-checkpoint"
QUESTION = "What shape is in the picture, and what colour is it?"


def demo_image() -> Image.Image:
    """A fixed drawing: a red circle on white."""
    image = Image.new("RGB", (160, 120), "white")
    ImageDraw.Draw(image).ellipse((50, 30, 110, 90), fill=(220, 30, 30))
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    random_weights = args.checkpoint == DEFAULT_CHECKPOINT
    if random_weights and not args.checkpoint.exists():
        make_random_checkpoint(args.checkpoint, preset="small", vision=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    messages = [{"role": "user", "content": [{"type": "image", "image": demo_image()},
                                             {"type": "text", "text": QUESTION}]}]
    result = pipe(text=messages, max_new_tokens=args.max_new_tokens, return_full_text=False,
                  generate_kwargs={"use_dspark": True, "do_sample": False})
    stats = model.last_generation_stats
    if random_weights:
        print("NOTE: these weights are RANDOM (no trained checkpoint yet): the answer below is noise.")
    print(f"question: {QUESTION}")
    print(f"answer:   {result[0]['generated_text']!r}")
    print(f"tokens/s: {stats['tokens_per_second']:.1f} ({stats['new_tokens']} tokens in {stats['seconds']:.2f} s, CPU)")
    print(f"DSpark mean accepted length: {stats['dspark_mean_accepted_length']:.2f} tokens per verification")
    print(f"cache: {stats['cache_global_bytes_per_token']:.0f} bytes of global KV per token")


if __name__ == "__main__":
    main()
