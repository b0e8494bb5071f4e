"""Inventory of torch.compile graph breaks in a decode step (issue #8: a decode step capturable whole).

Builds the model `decode_op_count.py` uses (the GPU suite's MEDIUM schedule at small widths,
`gpu_suite.medium_config(quick=True)`, random weights), forces the GPU formulations on the CPU (`fast_path`
patched to true, as `decode_op_count.py` does) and replaces each `compiled(f)` by the eager `f`, so that Dynamo
traces the fused helpers' own code instead of nesting a second `torch.compile`. It prefills a context into a
`DeepseekV41Cache`, runs one eager warm-up step, then runs `torch._dynamo.explain` on

  (a) one whole decode step, `model(input_ids=next_token, cache=cache)`, and
  (b) each backbone block's decode call, `model.layer_step(index, streams, pre_mix, context)`, with the streams
      and the `prepare_context` context of a real decode step (the layer loop, block by block).

Each explained call runs on a deep copy of the cache (and of the per-forward share), so the real cache advances
exactly once per step. Dynamo runs with its defaults (`capture_scalar_outputs` and
`capture_dynamic_output_shape_ops` off: a value read back or an op with a value-dependent output size breaks the
graph); `--capture-dynamic` turns both on, to see which breaks remain when Dynamo may trace unbacked sizes.

Prints the number of graphs and graph breaks, and the breaks grouped by source line (the innermost frame in the
model package) and reason, each classed as data-dependent (a tensor value or a value-dependent size reaches Python
or an output shape) or Python-side (a construct Dynamo does not trace).

Run: OMP_NUM_THREADS=1 python benchmarks/decode_graph_breaks.py [--context 600] [--batch 1] [--skip-step]
     [--capture-dynamic] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerator_paths import force_accelerator_paths  # noqa: E402
from gpu_suite import build_model, medium_config  # noqa: E402

import modeling_deepseek_v41  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402

PACKAGE = Path(modeling_deepseek_v41.__file__).resolve().parent

# a break is data-dependent when its reason names one of these (a value read back, or a value-dependent size);
# everything else is Python-side (a construct Dynamo cannot or will not trace)
DATA_DEPENDENT = (
    r"\.item\b", r"Tensor\.item", r"_local_scalar_dense", r"tolist", r"nonzero", r"masked_select",
    r"\bunique", r"repeat_interleave", r"data[- ]dependent", r"dynamic shape operator", r"dynamic_output_shape",
    r"unbacked", r"Unsupported Tensor\.item", r"generic_jump", r"jump.*tensor", r"boolean mask", r"bool\(",
    r"__bool__", r"__int__", r"int\(", r"guard on data",
)


def clean_reason(text: str) -> str:
    """The reason's first sentences, without addresses and other per-run numbers."""
    text = " ".join(str(text).split())
    text = text.split(" For more details about this graph break")[0]
    text = text.split(" Hint:")[0]
    text = re.sub(r"0x[0-9a-f]+", "0x..", text)
    text = re.sub(r"int: \d{6,}", "int: <address>", text)
    return text[:300]


def split_instruction(text: str) -> tuple[str, str]:
    """("CALL", rest) from "Encountered graph break when attempting to trace CALL: a function call, ...: rest"."""
    match = re.match(r"Encountered graph break when attempting to trace (\w+): [^:]*: (.*)", text)
    if match:
        return match.group(1), match.group(2)
    if text.startswith("Failed to handle graph break gracefully"):
        frame = re.search(r"frame (\w+ \([\w.]+:\d+\)) skipped", text)
        return (f"skip {frame.group(1)}" if frame else "frame skipped"), text.split("Graph break encountered: ", 1)[-1]
    return "-", text


class RecompileLog(logging.Handler):
    """Dynamo's `recompiles` log artifact (TORCH_LOGS=recompiles): the function and first failed guard."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        head = re.match(r"Recompiling function (\w+) in (\S+):(\d+)", lines[0]) if lines else None
        if head is None:
            return
        failure = next((line.strip() for line in lines[1:] if line.strip().startswith("- ")), "")
        failure = re.sub(r"^- \d+/\d+: ", "", failure)
        self.records.append((f"{head.group(1)} ({Path(head.group(2)).name}:{head.group(3)})", failure[:200]))


class BreakLog(logging.Handler):
    """Every graph break Dynamo logs (the `graph_breaks` log artifact, TORCH_LOGS=graph_breaks): its location
    (the innermost user frame) and reason. Unlike explain's break_reasons, this includes breaks that end a frame
    without a graph before them and frames Dynamo skips."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Graph break" not in message:
            return
        where = re.search(r"in user code at (\S+):(\d+)", message)
        site = f"{Path(where.group(1)).name}:{where.group(2)}" if where else "<skipped frame>"
        if where is None:
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', message)
            if frames:
                site = f"{Path(frames[-1][0]).name}:{frames[-1][1]} (frame skipped)"
        reason = re.search(r"Graph Break Reason: (.*)", message, re.DOTALL)
        text = reason.group(1) if reason else message.splitlines()[0]
        skipped = re.search(r"frame skipped: (\w+) \((\S+) line (\d+)\)", message)
        if skipped:  # a break inside a loop: Dynamo runs the whole enclosing frame eagerly
            text = (f"Failed to handle graph break gracefully: graph break in a for/while loop, frame "
                    f"{skipped.group(1)} ({Path(skipped.group(2)).name}:{skipped.group(3)}) skipped (runs eagerly). "
                    f"Graph break encountered: " + text.split("Graph break encountered:", 1)[-1])
        self.records.append((site, clean_reason(text)))



BREAKS, RECOMPILES = BreakLog(), RecompileLog()


def attach_logs() -> None:
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    for name in list(logging.root.manager.loggerDict):
        if name.endswith("__graph_breaks"):
            logging.getLogger(name).addHandler(BREAKS)
        if name.endswith("__recompiles"):
            logging.getLogger(name).addHandler(RECOMPILES)


def kind_of(reason_text: str) -> str:
    lowered = reason_text.lower()
    return "data-dependent" if any(re.search(p, lowered, re.IGNORECASE) for p in DATA_DEPENDENT) else "python-side"


def summarise(title: str, calls: list[tuple[object, list[tuple[str, str]]]]) -> dict:
    """calls: (explain output, logged breaks) per explained call."""
    outputs = [output for output, _ in calls]
    graphs = sum(o.graph_count for o in outputs)
    ops = sum(o.op_count for o in outputs)
    logged: Counter[tuple[str, str, str, str]] = Counter()
    for _, records in calls:
        for site, text in records:
            instruction, rest = split_instruction(text)
            logged[(site, kind_of(rest), instruction, rest)] += 1
    by_kind, by_site = Counter(), Counter()
    for (site, kind, _, _), count in logged.items():
        by_kind[kind] += count
        by_site[(site, kind)] += count
    print(f"\n=== {title} ===")
    print(f"graphs: {graphs}   graph breaks logged by Dynamo: {sum(logged.values())}   "
          f"(explain: graph_count - 1 = {sum(o.graph_break_count for o in outputs)}, break_reasons "
          f"{sum(len(o.break_reasons) for o in outputs)})   ops in graphs: {ops}")
    print("logged breaks by kind: " + (", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())) or "none"))
    print("logged breaks by site (innermost user frame) and kind:")
    for (site, kind), count in sorted(by_site.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {count:3d}  {kind:14s}  {site}  `{source_line(site)}`")
    print("the same, by the instruction Dynamo was tracing in the frame that broke (count, instruction, reason):")
    for (site, kind, instruction, rest), count in sorted(logged.items(), key=lambda item: (item[0][0], -item[1])):
        print(f"  {site:28s} {count:3d}  {instruction:16s} {rest[:160]}")
    return {"graphs": graphs, "breaks": sum(logged.values()), "by_kind": dict(by_kind)}


def source_line(site: str) -> str:
    match = re.match(r"([\w.]+):(\d+)", site)
    if not match:
        return ""
    for folder in (PACKAGE, Path(__file__).resolve().parent):
        path = folder / match.group(1)
        if path.exists():
            lines = path.read_text().splitlines()
            return lines[int(match.group(2)) - 1].strip() if int(match.group(2)) <= len(lines) else ""
    return ""


def explain(fn, *args, **kwargs) -> tuple[object, list[tuple[str, str]]]:
    """torch._dynamo.explain of one call, and the graph breaks Dynamo logged during it."""
    torch._dynamo.reset()
    first = len(BREAKS.records)
    output = torch._dynamo.explain(fn)(*args, **kwargs)
    return output, BREAKS.records[first:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--skip-step", action="store_true", help="only the block level (b)")
    parser.add_argument("--capture-dynamic", action="store_true",
                        help="let Dynamo trace .item() and value-dependent output sizes (unbacked symbols)")
    parser.add_argument("--steps", type=int, default=4,
                        help="(c): consecutive decode steps run through torch.compile to count recompilations")
    args = parser.parse_args()
    if args.capture_dynamic:
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.cache_size_limit = 64
    attach_logs()
    torch.manual_seed(0)
    model = build_model(medium_config(quick=True), "cpu")
    force_accelerator_paths(lambda function: function)  # the GPU formulations, every helper run eagerly
    text = model.config.text_config
    print(f"model: D {text.hidden_size}, {text.num_hidden_layers} layers, ratios {list(text.compress_ratios)}, "
          f"{text.n_routed_experts} experts top-{text.num_experts_per_tok}; context {args.context}, "
          f"batch {args.batch}; torch {torch.__version__}; capture_scalar_outputs="
          f"{torch._dynamo.config.capture_scalar_outputs}, capture_dynamic_output_shape_ops="
          f"{torch._dynamo.config.capture_dynamic_output_shape_ops}")
    ids = torch.randint(3, text.vocab_size, (args.batch, args.context + 3 + args.steps))
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(ids[:, :args.context], cache=cache, logits_to_keep=1)
        model(ids[:, args.context:args.context + 1], cache=cache)  # warm-up step (builds the expert stacks)
        t = args.context + 1

        # (a) one whole decode step
        if not args.skip_step:
            start = time.perf_counter()
            step = explain(model, input_ids=ids[:, t:t + 1], cache=copy.deepcopy(cache))
            print(f"\n(a) explain of one whole decode step took {time.perf_counter() - start:.1f} s")
            summarise("(a) whole decode step: model(input_ids=next_token, cache=cache)", [step])

        # (b) each block's decode call, inside a real eager decode step
        original = model.layer_step
        per_layer: list[tuple[int, object]] = []

        def explained_layer_step(index, streams, pre_mix, context):
            shadow = dataclasses.replace(context, share=copy.deepcopy(context.share))
            per_layer.append((index, explain(original, index, streams, pre_mix, shadow)))
            return original(index, streams, pre_mix, context)

        model.layer_step = explained_layer_step
        start = time.perf_counter()
        try:
            model(ids[:, t:t + 1], cache=cache)
        finally:
            del model.layer_step
        print(f"\n(b) explain of the {len(per_layer)} block calls took {time.perf_counter() - start:.1f} s")
        print("per block: index, role, graphs, breaks")
        for index, (output, records) in per_layer:
            spec = model.layers[index].spec
            role = (f"ratio {spec.ratio}" + (", owns pool" if spec.owns_pool else "")
                    + (", index source" if spec.is_index_source else "")
                    + (f", engram slot {spec.engram_slot}" if spec.engram_slot is not None else ""))
            print(f"  layer {index}: {role:45s} graphs {output.graph_count:3d}  logged breaks {len(records):3d}")
        summarise("(b) all backbone blocks' decode calls (layer_step), summed", [call for _, call in per_layer])

        # (c) consecutive decode steps through one torch.compile'd model: graphs compiled per step, recompilations
        if args.steps:
            torch._dynamo.reset()
            compiled_graphs = []

            def counting_backend(gm, example_inputs):
                compiled_graphs.append(gm)
                return gm.forward

            stepper = torch.compile(model, backend=counting_backend)
            shadow = copy.deepcopy(cache)
            first_recompile = len(RECOMPILES.records)
            per_step, recompiles_per_step = [], []
            start = time.perf_counter()
            for step in range(args.steps):
                before = len(compiled_graphs)
                position = args.context + 2 + step
                stepper(input_ids=ids[:, position:position + 1], cache=shadow)
                per_step.append(len(compiled_graphs) - before)
                recompiles_per_step.append(len(RECOMPILES.records) - first_recompile - sum(recompiles_per_step))
            print(f"\n=== (c) {args.steps} consecutive decode steps through torch.compile(model) "
                  f"({time.perf_counter() - start:.1f} s) ===")
            print("graphs compiled at each step: " + ", ".join(map(str, per_step)))
            print("recompilations at each step: " + ", ".join(map(str, recompiles_per_step)))
            print("recompilations by step (count, function, first failed guard):")
            offset = first_recompile
            for step, count in enumerate(recompiles_per_step):
                grouped = Counter((function, re.sub(r"\d{9,}", "<address>", failure).split("  #")[0].strip())
                                  for function, failure in RECOMPILES.records[offset:offset + count])
                offset += count
                for (function, failure), n in sorted(grouped.items()):
                    print(f"  step {step + 1}: {n:3d}  {function}: {failure[:110]}")


if __name__ == "__main__":
    main()
