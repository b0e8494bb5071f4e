"""Retrain only the default checkpoint's DSpark drafter with other settings and measure its acceptance.

Run: python benchmarks/drafter_settings.py --lr 6e-3 --anchors 48 --steps 300   (--anchors all: every position)
Loads examples/default-checkpoint in bf16 weight mode as fp32, re-initialises `mtp.*` with the model's own
initialiser, trains it with `training.build_default.train_drafter` (the build's drafter stage, other settings
replaced), then prints the mean accepted length on text and picture answers (`training.evaluate.drafting_stats`).
The backbone is the shipped one, unquantized, so compare runs of this script with each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.build_default import BuildSettings, seed_everything, train_drafter  # noqa: E402
from training.evaluate import drafting_stats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "examples" / "default-checkpoint"))
    defaults = BuildSettings()
    parser.add_argument("--lr", type=float, default=defaults.drafter_lr)
    parser.add_argument("--anchors", default=str(defaults.num_anchors), help="anchors per sequence, or 'all'")
    parser.add_argument("--steps", type=int, default=defaults.drafter_steps)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, weight_mode="bf16").float()
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    settings = dataclasses.replace(defaults, drafter_lr=args.lr, drafter_steps=args.steps,
                                   num_anchors=None if args.anchors == "all" else int(args.anchors))
    seed_everything(settings.seed)
    with torch.no_grad():
        model.mtp.apply(model._init_weights)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        train_drafter(model.train(), processor, settings, Path(tmp))
    stats = drafting_stats(model.eval(), processor, max_new_tokens=32, n_text=8, n_images=4)
    print(f"lr {args.lr}, anchors {args.anchors}, steps {args.steps}: trained in {time.perf_counter() - start:.0f} s; "
          f"mean accepted length text {stats['text']['mean_accepted_length']:.3f}, "
          f"picture answers {stats['image']['mean_accepted_length']:.3f}")


if __name__ == "__main__":
    main()
