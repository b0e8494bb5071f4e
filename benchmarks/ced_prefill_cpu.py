"""Prefill time, bounded_replay against exact, on the CPU for a small model, in one process.

Run: python benchmarks/ced_prefill_cpu.py [--lengths 4096 16384]
Random-weight model with the tiny-text fixture's schedule (8 layers, decoder from layer 4, window 16), bf16 weight
mode, batch 1, one prefill call into a fresh cache, median of 3 after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import random_model, tiny_config  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    model = random_model(tiny_config(max_position_embeddings=1 << 20), dtype=torch.bfloat16, seed=0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| prompt tokens | exact (s) | bounded_replay (s) | ratio |")
    print("|---|---|---|---|")
    for length in args.lengths:
        ids = torch.randint(3, model.config.text_config.vocab_size, (1, length))
        times = {}
        for mode in ("exact", "bounded_replay"):
            runs = []
            for repeat in range(4):
                start = time.perf_counter()
                with torch.no_grad():
                    model(ids, cache=DeepseekV41Cache(model.config), prefill_mode=mode, logits_to_keep=1)
                if repeat:
                    runs.append(time.perf_counter() - start)
            times[mode] = statistics.median(runs)
        print(f"| {length} | {times['exact']:.2f} | {times['bounded_replay']:.2f} | "
              f"{times['bounded_replay'] / times['exact']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
