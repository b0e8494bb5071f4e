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
from demo import ask, print_answer  # noqa: E402  (the main demo beside this file)

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
    answer, stats = ask(args.checkpoint, demo_image(), QUESTION, args.max_new_tokens)
    if random_weights:
        print("NOTE: these weights are RANDOM: the answer below is noise.")
    print_answer(QUESTION, answer, stats)

if __name__ == "__main__":
    main()
