"""Rebuild the embedded default checkpoint (examples/default-checkpoint) from scratch on the CPU.

    python examples/build_default.py [--out DIR] [--vision-warmup-steps N] [--backbone-steps N] [--drafter-steps N]
                                      [--self-distillation] [--seed N] [--no-eval]

Trains a small DeepSeek-V4.1 (every mechanism present) on generated pictures of coloured shapes with questions
and answers plus Python's own documentation text, trains its DSpark drafter with the backbone frozen, writes it in
the hub layout (FP8/FP4), then loads it back through the hub loader and measures held-out accuracy and the
drafter's mean accepted length (written to DIR/training_report.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.build_default import BuildSettings, build_default  # noqa: E402

DEFAULT_OUT = ROOT / "examples" / "default-checkpoint"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    defaults = BuildSettings()
    parser.add_argument("--backbone-steps", type=int, default=defaults.backbone_steps)
    parser.add_argument("--vision-warmup-steps", type=int, default=defaults.vision_warmup_steps,
                        help="steps of the ViT/aligner shape-and-colour warm-up (0 skips it)")
    parser.add_argument("--drafter-steps", type=int, default=defaults.drafter_steps)
    parser.add_argument("--self-distillation", action="store_true",
                        help="also train the drafter on the backbone's own greedy continuations of documentation text")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--text-every", type=int, default=defaults.text_every,
                        help="every N-th backbone training example is documentation text")
    parser.add_argument("--main-question-share", type=float, default=defaults.main_question_share)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads (default 1)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation of the written checkpoint")
    args = parser.parse_args()
    if args.out.exists():
        print(f"error: {args.out} exists; remove it first to rebuild", file=sys.stderr)
        return 4
    settings = BuildSettings(seed=args.seed, vision_warmup_steps=args.vision_warmup_steps,
                             backbone_steps=args.backbone_steps, drafter_steps=args.drafter_steps,
                             drafter_self_distillation=args.self_distillation,
                             threads=args.threads, text_every=args.text_every,
                             main_question_share=args.main_question_share)
    report = build_default(args.out, settings)
    if not args.no_eval:
        from training.evaluate import evaluate_checkpoint

        report["evaluation"] = evaluate_checkpoint(args.out)
        print(json.dumps(report["evaluation"], indent=2))
    for stage in ("vision", "backbone", "drafter"):
        if stage in report:
            report[stage]["log"] = [entry for entry in report[stage]["log"] if "loss" in entry]
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
