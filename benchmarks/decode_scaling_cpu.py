"""Decode step time against context on the CPU with the GPU's formulations, for any checkout of the model.

Run: GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296 OMP_NUM_THREADS=1 \
     python benchmarks/decode_scaling_cpu.py [--root CHECKOUT] [--contexts 4096 32768] [--steps 10] [--profile PREFIX]

The GPU suite's schedule at small widths (`gpu_suite.medium_config(quick=True)`), random weights, batch 1.
`compiled.fast_path` is forced on and compiled functions run eagerly (a checkout without `fast_path` gets its
fused sparse attention routed in), so the CPU dispatches the GPU's ops. The prefill is made cheap (chunks of 4096,
indexers, window/pool gathers and the attention softmax stubbed out for multi-token chunks): it still writes every
pool row, key, carry and window slot, so the cache a decode step sees has the shapes of a real one; the decode
steps run the real model. `--root` imports the package from another checkout (e.g. a `git worktree` of an older
commit) to compare commits on the same weights. `--profile PREFIX` writes one step's torch.profiler table (self
CPU time, and grouped by input shapes) to PREFIX_<context>.txt/.json. The malloc tunables keep large temporaries
in the heap instead of fresh mmaps, whose page faults otherwise add several ms of noise per large op.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--profile", default="")
args = parser.parse_args()
sys.path[:0] = [args.root, str(Path(args.root) / "benchmarks")]

import torch  # noqa: E402

import modeling_deepseek_v41.kernels.sparse_attention as sparse  # noqa: E402
import modeling_deepseek_v41.layers.attention as attention  # noqa: E402
import modeling_deepseek_v41.layers.indexer as indexer  # noqa: E402
from gpu_suite import build_model, medium_config  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402

REAL = {"index": indexer.DeepseekV41Indexer.forward, "window": attention.DeepseekV41Attention._window,
        "pool": attention.DeepseekV41Attention._pool_entries}


def take_accelerator_paths() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("modeling_deepseek_v41"):
            if hasattr(module, "compiled"):
                module.compiled = lambda function: function
            if hasattr(module, "fast_path"):
                module.fast_path = lambda x: x.dtype != torch.float64 and not torch.is_grad_enabled()
    inner = sparse._fused_sparse_attention if not hasattr(sparse, "fast_path") else attention.sparse_attention

    def attend(q, *rest):  # multi-token chunks are prefill here: their attention output is not needed
        return torch.zeros_like(q) if q.shape[1] > 1 else inner(q, *rest)

    attention.sparse_attention = attend


def cheap_index(self, x, qr, rotation, keys, visible, share):
    if x.shape[1] <= 64:
        return REAL["index"](self, x, qr, rotation, keys, visible, share)
    if self.spec.is_candidate_source:
        share.candidates = torch.full((*x.shape[:2], self.candidate_blocks), -1, dtype=torch.long)
    return torch.full((*x.shape[:2], self.topk), -1, dtype=torch.long)


def cheap_window(self, kv, positions, share, queries):
    if kv.shape[1] == 1:
        return REAL["window"](self, kv, positions, share, queries)
    q = positions[:, queries].shape[1]
    return kv.new_zeros(kv.shape[0], q, 0, kv.shape[-1]), torch.zeros(kv.shape[0], q, 0, dtype=torch.bool)


def cheap_pool_entries(self, selected, share, dtype):
    if selected.shape[1] == 1:
        return REAL["pool"](self, selected, share, dtype)
    return selected.new_zeros(*selected.shape[:2], 0, self.head_dim, dtype=dtype)


def cheap_prefill(on: bool) -> None:
    indexer.DeepseekV41Indexer.forward = cheap_index if on else REAL["index"]
    attention.DeepseekV41Attention._window = cheap_window if on else REAL["window"]
    attention.DeepseekV41Attention._pool_entries = cheap_pool_entries if on else REAL["pool"]


def main() -> None:
    torch.manual_seed(0)
    model = build_model(medium_config(quick=True), "cpu")
    take_accelerator_paths()
    vocab = model.config.text_config.vocab_size
    print(f"root {args.root}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for context in args.contexts:
        ids = torch.randint(3, vocab, (1, context + args.steps + 3), generator=torch.Generator().manual_seed(1))
        cache = DeepseekV41Cache(model.config)
        with torch.no_grad():
            cheap_prefill(True)
            start = time.perf_counter()
            for s in range(0, context, 4096):
                model(ids[:, s:min(s + 4096, context)], cache=cache, logits_to_keep=1)
            prefill = time.perf_counter() - start
            cheap_prefill(False)
            for t in range(context, context + 2):  # warm-up
                model(ids[:, t:t + 1], cache=cache)
            times = []
            for t in range(context + 2, context + 2 + args.steps):
                start = time.perf_counter()
                logits = model(ids[:, t:t + 1], cache=cache).logits
                times.append(1e3 * (time.perf_counter() - start))
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                t = context + 2 + args.steps
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    model(ids[:, t:t + 1], cache=cache)
                by_shape = prof.key_averages(group_by_input_shape=True)
                json.dump([{"op": e.key, "shapes": str(e.input_shapes), "count": e.count,
                            "self_us": e.self_cpu_time_total} for e in by_shape],
                          open(f"{args.profile}_{context}.json", "w"))
                with open(f"{args.profile}_{context}.txt", "w") as f:
                    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n")
                    f.write(by_shape.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=40,
                                           max_shapes_column_width=120))
        times.sort()
        print(json.dumps({"context": context, "prefill_s": round(prefill, 1),
                          "step_ms_median": round(times[len(times) // 2], 2), "step_ms_min": round(times[0], 2),
                          "logits_checksum": float(logits[0, -1].float().sum())}), flush=True)
        del cache


if __name__ == "__main__":
    main()
