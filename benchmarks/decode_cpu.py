"""Decode step time against context length on the CPU, split into indexer scans and everything else.

Run: python benchmarks/decode_cpu.py [--contexts 1024 4096 16384] [--steps 20]
A random-weight model with the tiny-text fixture's schedule (bf16 weight mode) is prefilled in chunks, then
timed for single-token decode steps. Time inside the indexers (the only part that scans the compressed history)
is measured with forward hooks; the rest should not grow with the context.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import random_model, tiny_config  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.layers.indexer import DeepseekV41Indexer  # noqa: E402


class IndexerTimer:
    """Accumulates wall time spent inside indexer forwards."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        for module in model.modules():
            if isinstance(module, DeepseekV41Indexer):
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop)

    def _start(self, *_):
        self._t = time.perf_counter()

    def _stop(self, *_):
        self.total += time.perf_counter() - self._t


def measure(context: int, steps: int, chunk: int = 1024) -> dict:
    model = random_model(tiny_config(max_position_embeddings=1 << 20), dtype=torch.bfloat16, seed=0)
    timer = IndexerTimer(model)
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (1, context + steps))
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        for start in range(0, context, chunk):
            model(ids[:, start:min(start + chunk, context)], cache=cache)
        model(ids[:, context:context + 1], cache=cache)  # warm-up step
        timer.total = 0.0
        begin = time.perf_counter()
        for t in range(context + 1, context + steps):
            model(ids[:, t:t + 1], cache=cache)
        elapsed = time.perf_counter() - begin
    n = steps - 1
    return {"context": context, "step_ms": 1e3 * elapsed / n, "indexer_ms": 1e3 * timer.total / n,
            "other_ms": 1e3 * (elapsed - timer.total) / n,
            "global_bytes_per_token": cache.global_bytes_per_token()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=21)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| context | decode step (ms) | indexers (ms) | everything else (ms) | global KV bytes/token |")
    print("|---|---|---|---|---|")
    for context in args.contexts:
        r = measure(context, args.steps)
        print(f"| {r['context']} | {r['step_ms']:.1f} | {r['indexer_ms']:.1f} | {r['other_ms']:.1f} | "
              f"{r['global_bytes_per_token']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
