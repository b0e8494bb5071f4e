"""CPU proxy for the GPU decode step's host cost: aten ops dispatched and host synchronisations per decode step.

A GPU decode step of this model is launch/host-bound, so what matters there is how many ops the host dispatches
and how often it waits for the device (reading a tensor value back: `.item()`, `int()`, `bool()`, `.tolist()`,
boolean-mask indexing, `unique`, `nonzero`). Both are counted here on the CPU with a TorchDispatchMode, on a
random-weight model with the GPU suite's MEDIUM schedule at small widths (`gpu_suite.medium_config(quick=True)`).
By default the CPU takes the paths a GPU takes (`compiled.fast_path` forced on) and each call of a function that
the GPU compiles counts as one fused op, its inner ops uncounted; `--paths cpu` counts the CPU's own exact paths.

Run: python benchmarks/decode_op_count.py [--context 600] [--steps 8] [--batch 1] [--paths accelerator|cpu]
     [--by-module] [--sync-sites] [--top N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerator_paths import force_accelerator_paths  # noqa: E402
from gpu_suite import build_model, medium_config  # noqa: E402

from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402

# ops whose result the host must wait for (a value read back, or an output size that depends on values)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave.Tensor", "equal")
# module types an op is attributed to (the innermost one wins); the rest is "other"
TRACKED = ("DeepseekV41Indexer", "DeepseekV41Compressor", "DeepseekV41MoE", "DeepseekV41Engram",
           "DeepseekV41Attention", "DeepseekV41BackboneBlock", "DeepseekV41DSparkBlock")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched, the synchronising ones, and (optionally) where each sync came from."""

    def __init__(self, sync_sites: bool = False, op_sites: bool = False) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.by_module: Counter[str] = Counter()
        self.module_stack: list[str] = []
        self.record_sites = sync_sites
        self.record_op_sites = op_sites
        self.op_sites: Counter[str] = Counter()
        self.fused_depth = 0  # > 0 inside a compiled region: its ops are one fused op, already counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fused_depth:
            return func(*args, **(kwargs or {}))
        name = func.name().split("::", 1)[-1]
        self.ops[name] += 1
        self.by_module[self.module_stack[-1] if self.module_stack else "other"] += 1
        if self.record_op_sites:
            self.op_sites[_caller()] += 1
        if name.split(".")[0] in SYNC_OPS or name in SYNC_OPS:
            self.syncs[name] += 1
            if self.record_sites:
                self.sites[_caller()] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame inside the model package."""
    for frame in reversed(traceback.extract_stack()):
        if "modeling_deepseek_v41" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return "outside the model"


class TolistCounter:
    """`Tensor.tolist` reads values without an aten op on the CPU; count its calls separately."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = torch.Tensor.tolist

    def __enter__(self) -> "TolistCounter":
        original = self._original

        def counting(tensor, *args, **kwargs):
            self.calls += 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = counting
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.tolist = self._original


def take_accelerator_paths(counter: OpCounter) -> None:
    """Force the GPU formulations on the CPU and count each compiled-function call as one fused op."""
    def fused(function):
        def run(*args, **kwargs):
            counter.ops["<compiled region>"] += 1
            counter.by_module[counter.module_stack[-1] if counter.module_stack else "other"] += 1
            counter.fused_depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                counter.fused_depth -= 1
        return run

    force_accelerator_paths(fused)


def attach_module_stack(model: torch.nn.Module, counter: OpCounter) -> list:
    def enter(module, args) -> None:
        counter.module_stack.append(type(module).__name__)

    def leave(module, args, output) -> None:  # returns None: the output stays as it is
        counter.module_stack.pop()

    handles = []
    for module in model.modules():
        if type(module).__name__ in TRACKED:
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--paths", choices=("accelerator", "cpu"), default="accelerator")
    parser.add_argument("--by-module", action="store_true", help="ops per step attributed to module types")
    parser.add_argument("--sync-sites", action="store_true", help="list where the syncs come from")
    parser.add_argument("--op-sites", type=int, default=0, help="list the N source lines dispatching most ops")
    parser.add_argument("--top", type=int, default=0, help="list the N most frequent ops")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_model(medium_config(quick=True), "cpu")
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.context + 2 * args.steps + 2))
    cache = DeepseekV41Cache(model.config)
    counter = OpCounter(sync_sites=args.sync_sites, op_sites=args.op_sites > 0)
    if args.paths == "accelerator":
        take_accelerator_paths(counter)
    with torch.no_grad():
        model(ids[:, :args.context], cache=cache, logits_to_keep=1)
        model(ids[:, args.context:args.context + 1], cache=cache)  # warm-up step
        handles = attach_module_stack(model, counter) if args.by_module else []
        elapsed = 0.0
        with TolistCounter() as tolist:
            for t in range(args.context + 1, args.context + 1 + args.steps):
                with counter:
                    start = time.perf_counter()
                    model(ids[:, t:t + 1], cache=cache)
                    elapsed += time.perf_counter() - start
        for handle in handles:
            handle.remove()
        # the same steps again without the counter for an unperturbed wall time
        start = time.perf_counter()
        for t in range(args.context + 1 + args.steps, args.context + 1 + 2 * args.steps):
            model(ids[:, t:t + 1], cache=cache)
        plain = time.perf_counter() - start
    n = args.steps
    result = {
        "paths": args.paths, "context": args.context, "batch": args.batch, "steps": n,
        "aten_ops_per_step": sum(counter.ops.values()) / n,
        "host_syncs_per_step": (sum(counter.syncs.values()) + tolist.calls) / n,
        "syncs_by_op_per_step": {k: v / n for k, v in sorted(counter.syncs.items())} | {"tolist": tolist.calls / n},
        "wall_ms_per_step": 1e3 * plain / n,
    }
    print(json.dumps(result, indent=1))
    if args.by_module:
        print("ops per step by module (innermost tracked module):")
        for name, count in counter.by_module.most_common():
            print(f"  {name:28s} {count / n:8.1f}")
    if args.sync_sites:
        print("sync sites per step:")
        for site, count in counter.sites.most_common():
            print(f"  {count / n:6.1f}  {site}")
    if args.op_sites:
        print("source lines dispatching the most ops per step:")
        for site, count in counter.op_sites.most_common(args.op_sites):
            print(f"  {count / n:7.1f}  {site}")
    if args.top:
        print(f"top {args.top} ops per step:")
        for name, count in counter.ops.most_common(args.top):
            print(f"  {name:40s} {count / n:8.1f}")


if __name__ == "__main__":
    main()
