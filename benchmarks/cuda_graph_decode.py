"""Decode steps replayed from a CUDA graph (DeepseekV41CUDAGraphDecoder) against eager steps on a growing cache
and against transformers' in-tree DeepseekV4ForCausalLM at matched width and depth, all in one process.

For each context: prefill once and copy the cache; run eager steps on one copy and graph-replayed steps on the
other with the same tokens; compare their logits; then time both (CUDA-synchronised medians).

With --generate N, also times model.generate() of N new tokens after a 1,024-token prompt, plain and with
cuda_graphs=True (greedy; the tokens must be the same).

Run: python benchmarks/cuda_graph_decode.py [--contexts 1024 4096 65536] [--steps 20] [--no-baseline]
     [--generate 128]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import build_model, intree_v4_decode, medium_config, timed  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from modeling_deepseek_v41.model.generation import DeepseekV41CUDAGraphDecoder  # noqa: E402

CHECKED = 6  # steps whose logits are compared (the first two are the decoder's eager and recording steps)


def measure(model, context: int, steps: int, chunk: int = 4096) -> dict:
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (1, context + CHECKED + 2 * steps + 8), device="cuda")
    growing = DeepseekV41Cache(model.config)
    with torch.no_grad():
        for start in range(0, context, chunk):
            model(ids[:, start:min(start + chunk, context)], cache=growing, logits_to_keep=1)
        static = copy.deepcopy(growing)
        eager_logits = [model(ids[:, t:t + 1], cache=growing).logits.float()
                        for t in range(context, context + CHECKED)]
    decoder = DeepseekV41CUDAGraphDecoder(model, static, max_new_tokens=CHECKED + 2 * steps + 4)
    graph_logits = [decoder.step(ids[:, t:t + 1]).float() for t in range(context, context + CHECKED)]
    relative = max(float((g - e).norm() / e.norm()) for g, e in zip(graph_logits, eager_logits))
    agree = sum(bool(torch.equal(g.argmax(-1), e.argmax(-1))) for g, e in zip(graph_logits, eager_logits))
    position = [context + CHECKED]

    def eager_step():
        with torch.no_grad():
            model(ids[:, position[0]:position[0] + 1], cache=growing)
        position[0] += 1

    def graph_step():
        decoder.step(ids[:, position[0]:position[0] + 1])
        position[0] += 1

    eager_ms = timed(eager_step, "cuda", repeats=steps, warmup=1)
    position[0] = context + CHECKED
    graph_ms = timed(graph_step, "cuda", repeats=steps, warmup=1)
    decoder.close()
    row = {"context": context, "eager_ms": eager_ms, "graph_ms": graph_ms, "graph_speedup": eager_ms / graph_ms,
           "graph_tokens_per_s": 1e3 / graph_ms, "max_relative_l2_vs_eager": relative,
           "argmax_agreement": f"{agree}/{CHECKED}", "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    torch.cuda.reset_peak_memory_stats()
    print(json.dumps(row), flush=True)
    return row


def generate_speed(model, new_tokens: int, prompt: int = 1024) -> dict:
    ids = torch.randint(3, model.config.text_config.vocab_size, (1, prompt), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False)
    outputs, seconds = {}, {}
    for graphs in (False, True, False, True):  # the first of each warms up (compilation, recording)
        stats = {}
        outputs[graphs] = model.generate(ids, cuda_graphs=graphs, generation_stats=stats, **kwargs)
        seconds[graphs] = stats["seconds"]
    row = {"generate_new_tokens": new_tokens, "prompt": prompt, "plain_tok_s": new_tokens / seconds[False],
           "cuda_graphs_tok_s": new_tokens / seconds[True], "speedup": seconds[False] / seconds[True],
           "same_tokens": bool(torch.equal(outputs[False], outputs[True]))}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 65536])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true", help="skip the in-tree V4 baseline")
    parser.add_argument("--generate", type=int, default=0, help="also time generate() of this many new tokens")
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    model = build_model(medium_config(quick=False), "cuda")
    if not args.no_baseline:
        print(json.dumps({"baseline": intree_v4_decode("cuda", min(args.contexts), quick=False)}), flush=True)
    rows = [measure(model, context, args.steps) for context in args.contexts]
    if args.generate:
        generate_speed(model, args.generate)
    by_context = {row["context"]: row["graph_ms"] for row in rows}
    if 4096 in by_context and 65536 in by_context:
        print(json.dumps({"graph_64k_over_4k": by_context[65536] / by_context[4096]}), flush=True)


if __name__ == "__main__":
    main()
