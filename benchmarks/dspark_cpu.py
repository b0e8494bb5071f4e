"""DSpark drafting on the CPU: mean accepted length and tokens/s with and without drafting, greedy.

Run: python benchmarks/dspark_cpu.py [--new-tokens 64]
Uses the tiny-text reference fixture's checkpoint (synthetic weights, quantized mode). Its drafter was not
trained with its backbone, so acceptance is low; the trained default model's numbers belong to the training work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference_cases import FIXTURES, load_case, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    folder = str(FIXTURES / "tiny-text")
    model, case = load_model(folder), load_case(folder)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| prompt | drafting | new tokens | tokens/s | mean accepted length | same tokens |")
    print("|---|---|---|---|---|---|")
    for row in range(case.inputs["input_ids"].shape[0]):
        ids = case.inputs["input_ids"][row:row + 1, :32]
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=2)
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=2)  # warm-up
        base, draft = {}, {}
        plain = model.generate(ids, generation_stats=base, **common)
        drafted = model.generate(ids, use_dspark=True, generation_stats=draft, **common)
        same = bool(torch.equal(plain, drafted))
        print(f"| {row} | off | {base['new_tokens']} | {base['tokens_per_second']:.1f} | 1.00 | |")
        print(f"| {row} | on | {draft['new_tokens']} | {draft['tokens_per_second']:.1f} | "
              f"{draft['dspark_mean_accepted_length']:.2f} | {same} |")


if __name__ == "__main__":
    main()
