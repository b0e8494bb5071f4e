"""Which accelerator formulation moves the fixtures' logits: the Triton kernels, the closed-form attention, the
gathered MoE and the other fast paths switched off one at a time, each variant's logits against the reference's
(median per-row relative L2 / top-1 agreement, the fixtures' README measures). Meant for a GPU; on the CPU every
variant is the exact path. `--by-module` adds one variant per module with kernels: its kernels alone on. With
images, the vision tower's output is pinned to the reference's (`aligner_output.image0`) in a second pass, so that
what the language model's formulations do is seen apart from a cuBLAS rounding in the aligner.

    python benchmarks/fidelity_by_formulation.py [--by-module]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import modeling_deepseek_v41.kernels.expert_ops as expert_ops  # noqa: E402
import modeling_deepseek_v41.kernels.sparse_attention as sparse_attention  # noqa: E402
from reference_cases import load_case, load_model, model_case_dirs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODULES = [m for name, m in list(sys.modules.items()) if name.startswith("modeling_deepseek_v41")]
KERNEL_PATHS = {m: m.kernel_path for m in MODULES if hasattr(m, "kernel_path")}
FAST_PATHS = {m: m.fast_path for m in MODULES if hasattr(m, "fast_path")}
VARIANTS = [("all on", {}), ("kernels off", dict(kernels=False)),
            ("kernels off, attention off", dict(kernels=False, attention=False)),
            ("kernels off, MoE off", dict(kernels=False, moe=False)),
            ("every formulation off", dict(kernels=False, attention=False, moe=False, others=False)),
            ("kernels on, attention off", dict(attention=False))]


def never(x: torch.Tensor) -> bool:
    return False


def choose(kernels: bool = True, attention: bool = True, moe: bool = True, others: bool = True,
           only=None) -> None:
    """Switch formulations off; `only`: the one module whose kernels stay on (the others' are off)."""
    for module, predicate in KERNEL_PATHS.items():
        module.kernel_path = predicate if kernels and (only is None or module is only) else never
    for module, predicate in FAST_PATHS.items():
        module.fast_path = predicate if others else never
    sparse_attention.fast_path = FAST_PATHS[sparse_attention] if attention else never
    expert_ops.fast_path = FAST_PATHS[expert_ops] if moe else never


def agreement(logits: torch.Tensor, expected: torch.Tensor) -> str:
    logits, expected = logits.float().cpu(), expected.float().cpu()
    rel = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    return f"{float(rel.median()):.4f}/{float((logits.argmax(-1) == expected.argmax(-1)).float().mean()):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--by-module", action="store_true", help="also each module's kernels alone")
    args = parser.parse_args()
    variants = list(VARIANTS)
    if args.by_module:
        variants += [(f"only {m.__name__.split('.')[-1]} kernels", dict(only=m)) for m in KERNEL_PATHS]
    print(f"device {DEVICE}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32}", flush=True)
    for case_dir in model_case_dirs():
        case = load_case(case_dir)
        model = copy.deepcopy(load_model(str(case_dir))).to(DEVICE).eval()
        inputs = {k: v.to(DEVICE) for k, v in case.model_inputs().items()}
        clean = [int(c) for c in case.expected["clean_prefix"]]
        pinned = case.expected.get("aligner_output.image0")
        for pin in (False, True) if pinned is not None else (False,):
            hook = model.model.aligner.register_forward_hook(
                lambda module, args, out: pinned.to(out.device, out.dtype).view_as(out)) if pin else None
            for label, switches in variants:
                choose(**switches)
                with torch.no_grad():
                    logits = model(**inputs).logits
                rows = [agreement(logits[r, :c], case.expected["logits"][r, :c]) for r, c in enumerate(clean)]
                name = case_dir.name + (" (aligner pinned)" if pin else "")
                print(f"{name:<30} {label:<32}", " ".join(rows), flush=True)
            if hook is not None:
                hook.remove()
        choose()


if __name__ == "__main__":
    main()
