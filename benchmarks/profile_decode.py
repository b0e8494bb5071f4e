"""Profile one decode step of the medium benchmark model: where the time goes, by operator and by module.

Run (on a CUDA machine): python benchmarks/profile_decode.py [--context 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import build_model, medium_config  # noqa: E402

from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(medium_config(args.quick), device)
    ids = torch.randint(3, model.config.text_config.vocab_size, (1, args.context + 40), device=device)
    cache = DeepseekV41Cache(model.config)
    module_time = defaultdict(float)

    def pre(module, *_):
        if device == "cuda":
            torch.cuda.synchronize()
        module._t0 = time.perf_counter()

    def post(module, *_):
        if device == "cuda":
            torch.cuda.synchronize()
        module_time[type(module).__name__] += time.perf_counter() - module._t0

    with torch.no_grad():
        model(ids[:, :args.context], cache=cache, logits_to_keep=1)
        for t in range(args.context, args.context + 3):
            model(ids[:, t:t + 1], cache=cache)
        handles = []
        for module in model.modules():
            if type(module).__name__ in ("DeepseekV41Attention", "DeepseekV41MoE", "DeepseekV41Indexer",
                                         "DeepseekV41Compressor", "DeepseekV41Engram", "DeepseekV41RMSNorm"):
                handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        steps = 5
        for t in range(args.context + 3, args.context + 3 + steps):
            model(ids[:, t:t + 1], cache=cache)
        for handle in handles:
            handle.remove()
        print("per-step time by module type (ms, synchronised, nested modules counted in their parents too):")
        for name, seconds in sorted(module_time.items(), key=lambda kv: -kv[1]):
            print(f"  {name:28s} {1e3 * seconds / steps:8.2f}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for t in range(args.context + 10, args.context + 12):
                model(ids[:, t:t + 1], cache=cache)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
