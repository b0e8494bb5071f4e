"""How far the CED approximations are from exact prefill: bounded-replay prefill, and a restored prefix cache.

Run: python benchmarks/ced_distance.py
For each case, the next-token distribution after the prompt is compared with exact prefill: top-1 agreement and
KL(exact || approximation). Cases: the two reference fixtures (quantized checkpoints, synthetic weights) and
random float64 models with the tiny-text schedule (5 seeds, 2 prompts each). The restored-cache rows save a
prefix of all but the last 8 prompt tokens and continue with those 8.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import random_model  # noqa: E402
from modeling_deepseek_v41.cache import DeepseekV41Cache  # noqa: E402
from reference_cases import load_case, load_model, model_case_dirs  # noqa: E402


def distance(exact: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p, q = exact.float().log_softmax(-1), approx.float().log_softmax(-1)
    return (exact.argmax(-1) == approx.argmax(-1)).float(), (p.exp() * (p - q)).sum(-1)


def compare(model, kwargs: dict, tail: int = 8) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ids = kwargs["input_ids"]
    with torch.no_grad():
        exact = model(**kwargs).logits[:, -1]
        bounded = model(**kwargs, cache=DeepseekV41Cache(model.config), prefill_mode="bounded_replay").logits[:, -1]
        results = {"bounded_replay": distance(exact, bounded)}
        if "pixel_values" not in kwargs:
            cache = DeepseekV41Cache(model.config)
            model(ids[:, :-tail], cache=cache)
            with tempfile.TemporaryDirectory() as folder:
                cache.save(Path(folder) / "prefix.cache", model)
                restored = DeepseekV41Cache.load(Path(folder) / "prefix.cache", model)
            continued = model(ids[:, -tail:], cache=restored).logits[:, -1]
            results["restored_prefix"] = distance(exact, continued)
    return results


def report(name: str, rows: list[dict]) -> None:
    for mode in rows[0]:
        agree = torch.cat([r[mode][0] for r in rows if mode in r])
        kl = torch.cat([r[mode][1] for r in rows if mode in r])
        print(f"| {name} | {mode} | {len(agree)} | {float(agree.mean()):.3f} | {float(kl.median()):.2e} | "
              f"{float(kl.max()):.2e} |")


def main() -> None:
    print("| case | approximation | prompts | top-1 agreement | KL median | KL max |")
    print("|---|---|---|---|---|---|")
    for folder in model_case_dirs():
        case, model = load_case(str(folder)), load_model(str(folder))
        report(folder.name, [compare(model, case.model_inputs())])
    rows = []
    for seed in range(5):
        model = random_model(dtype=torch.float64, seed=100 + seed)
        torch.manual_seed(seed)
        rows.append(compare(model, {"input_ids": torch.randint(3, 500, (2, 96))}))
    report("random float64 models (tiny-text schedule)", rows)


if __name__ == "__main__":
    main()
