"""The V4.1 optimizer recipe against plain AdamW on a small random model and a fixed random bigram process.

Each optimizer is compared at its own best learning rate. First a sweep at seed 0: both optimizers at every
learning rate of `--lrs`, same initial weights, batches and schedule. Each optimizer's best learning rate is chosen
by two criteria: the lowest held-out loss after training, and the lowest mean training loss over the run (the area
under the loss curve: the speed measure). If a best one is the largest (smallest) tried, the sweep is extended by
doubling (halving), up to `--max-extend` times per side, so the chosen values are bracketed by worse ones. Then both
optimizers run at their chosen learning rates with the other seeds of `--seeds` (another initialisation and another
batch stream from the same bigram process per seed; the held-out set is the same for every run). The report gives
the sweep, per-seed and paired (recipe - AdamW) tables at the chosen rates, steps to reach each of `--thresholds`,
and a best-against-best table (each optimizer's best value of every measure over its chosen rates).

The recipe run uses `create_optimizer` (head-wise Muon / Sinkhorn / AdamW, all constants the recipe's) plus the
per-modality bias balancing with its sequence-level loss; the logged loss is the language-model cross-entropy alone
(the balance term is subtracted). "AdamW" is torch.optim.AdamW(betas=(0.9, 0.95), weight_decay=0.1) on every
trainable tensor.

Run: python benchmarks/optimizer_recipe.py --threads 1 [--steps 300] [--lrs 3e-3 1e-2 2e-2 4e-2] [--seeds 3]
     [--cache runs.json]
Writes benchmarks/optimizer_recipe_curves.png (needs matplotlib) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import random_model, tiny_config  # noqa: E402
from training.expert_balancing import ExpertBalancer  # noqa: E402
from training.optimizer_recipe import create_optimizer  # noqa: E402

NAMES = ("AdamW", "V4.1 recipe")


class BigramProcess:
    """A fixed Markov chain over the vocabulary: every token has a handful of likely successors."""

    def __init__(self, vocab: int, successors: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -1e9)
        for token in range(vocab):
            chosen = torch.randperm(vocab, generator=generator)[:successors]
            logits[token, chosen] = torch.randn(successors, generator=generator)
        self.probs = logits.softmax(dim=-1)

    def entropy_rate(self) -> float:
        """Mean next-token entropy under the uniform start distribution (the loss floor, near the stationary one)."""
        p = self.probs
        return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.probs.shape[0], (batch,), generator=generator)
        for t in range(1, length):
            tokens[:, t] = torch.multinomial(self.probs[tokens[:, t - 1]], 1, generator=generator).squeeze(1)
        return tokens


def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(recipe: bool, batches: list[torch.Tensor], held_out: torch.Tensor, lr: float, warmup: int,
          seed: int) -> dict:
    model = random_model(tiny_config(), dtype=torch.float32, seed=seed).train()
    if recipe:
        optimizer = create_optimizer(model, lr=lr)
        balancer = ExpertBalancer(model).attach()
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                      betas=(0.9, 0.95), weight_decay=0.1)
        balancer = None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, len(batches), warmup))
    losses, start = [], time.perf_counter()
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        lm_loss = loss.detach() - (balancer.last_balance_loss.detach() if balancer else 0.0)
        losses.append(float(lm_loss))
        if balancer:
            balancer.update_biases()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        held = float(model(held_out, labels=held_out).loss)
    return {"losses": losses, "held_out": held, "seconds": seconds,
            "balance": balancer.last_stats if balancer else {}}


def smooth(values: list[float], width: int = 10) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def first_step_below(values: list[float], threshold: float) -> int | None:
    """First step whose 10-step mean training loss is at most `threshold` (None: never)."""
    for step, value in enumerate(smooth(values)):
        if value <= threshold:
            return step + 1
    return None


def mean_loss(values: list[float]) -> float:
    """Area under the training-loss curve divided by the number of steps: lower means faster overall."""
    return sum(values) / len(values)


def tail_loss(values: list[float], width: int = 20) -> float:
    """Mean training loss over the last `width` steps."""
    return sum(values[-width:]) / len(values[-width:])


CRITERIA = {
    "held-out": ("lowest held-out loss after training", lambda run: run["held_out"]),
    "area": ("lowest mean training loss over the run (area under the curve: fastest overall)",
             lambda run: mean_loss(run["losses"])),
}


def score(run: dict, criterion: str) -> float:
    """Selection key under `criterion`; a diverged (non-finite) run counts as worst."""
    value = CRITERIA[criterion][1](run)
    return value if math.isfinite(value) else math.inf


def fmt_step(step: int | None) -> str:
    return "never" if step is None else str(step)


Runs = dict[tuple[str, float, int], dict]
Best = dict[str, dict[str, float]]  # criterion -> optimizer name -> learning rate


def steps_cells(losses: list[float], thresholds: list[float]) -> str:
    return " | ".join(fmt_step(first_step_below(losses, t)) for t in thresholds)


def sweep_table(runs: Runs, thresholds: list[float], best: Best) -> None:
    print("| optimizer | lr | loss @50 | loss @100 | loss @200 | mean train loss (area / steps) | "
          "final train loss (last 20) | held-out loss | "
          + " | ".join(f"steps to <= {t:g}" for t in thresholds) + " | wall s |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(thresholds) + "---|")
    for name in NAMES:
        for (n, lr, seed), run in sorted(runs.items(), key=lambda kv: kv[0][1]):
            if n != name or seed != 0:
                continue
            s = smooth(run["losses"])
            at = [f"{s[min(k, len(s)) - 1]:.3f}" for k in (50, 100, 200)]
            marks = [c for c in CRITERIA if best[c][name] == lr]
            mark = f" **(best {', '.join(marks)})**" if marks else ""
            print(f"| {name} | {lr:g}{mark} | {' | '.join(at)} | {mean_loss(run['losses']):.3f} | "
                  f"{tail_loss(run['losses']):.3f} | {run['held_out']:.3f} | {steps_cells(run['losses'], thresholds)}"
                  f" | {run['seconds']:.0f} |")


def best_lr_tables(runs: Runs, thresholds: list[float], best: dict[str, float], seeds: list[int]) -> None:
    """Per seed, both optimizers at the given learning rates, and the paired difference recipe - AdamW."""
    print("| seed | optimizer (lr) | mean train loss (area / steps) | final train loss (last 20) | held-out loss | "
          + " | ".join(f"steps to <= {t:g}" for t in thresholds) + " |")
    print("|---|---|---|---|---|" + "---|" * len(thresholds))
    for seed in seeds:
        for name in NAMES:
            run = runs[(name, best[name], seed)]
            print(f"| {seed} | {name} ({best[name]:g}) | {mean_loss(run['losses']):.3f} | "
                  f"{tail_loss(run['losses']):.3f} | {run['held_out']:.3f} | "
                  f"{steps_cells(run['losses'], thresholds)} |")
    print()
    print("Paired difference, recipe minus AdamW, same seed (negative: the recipe is lower / reaches it sooner):")
    print()
    print("| seed | mean train loss | final train loss | held-out loss | "
          + " | ".join(f"steps to <= {t:g}" for t in thresholds) + " |")
    print("|---|---|---|---|" + "---|" * len(thresholds))
    columns: dict[str, list[float]] = {}
    for seed in seeds:
        a, r = runs[("AdamW", best["AdamW"], seed)], runs[("V4.1 recipe", best["V4.1 recipe"], seed)]
        cells = {
            "mean": mean_loss(r["losses"]) - mean_loss(a["losses"]),
            "tail": tail_loss(r["losses"]) - tail_loss(a["losses"]),
            "held": r["held_out"] - a["held_out"],
        }
        for t in thresholds:
            sa, sr = first_step_below(a["losses"], t), first_step_below(r["losses"], t)
            cells[f"t{t}"] = math.nan if sa is None or sr is None else sr - sa
        for key, value in cells.items():
            columns.setdefault(key, []).append(value)
        print(f"| {seed} | {cells['mean']:+.3f} | {cells['tail']:+.3f} | {cells['held']:+.3f} | "
              + " | ".join("n/a" if math.isnan(cells[f't{t}']) else f"{cells[f't{t}']:+.0f}" for t in thresholds)
              + " |")

    def summary(values: list[float], digits: int) -> str:
        kept = [v for v in values if not math.isnan(v)]
        if not kept:
            return "n/a"
        spread = f" (min {min(kept):+.{digits}f}, max {max(kept):+.{digits}f})" if len(kept) > 1 else ""
        return f"{statistics.mean(kept):+.{digits}f}{spread}"

    print(f"| mean over {len(seeds)} | {summary(columns['mean'], 3)} | {summary(columns['tail'], 3)} | "
          f"{summary(columns['held'], 3)} | " + " | ".join(summary(columns[f't{t}'], 1) for t in thresholds) + " |")


def best_vs_best_table(runs: Runs, thresholds: list[float], best: Best, seeds: list[int]) -> None:
    """Per measure: each optimizer's best value over its chosen learning rates (means over the seeds)."""
    measures: list[tuple[str, Callable[[dict], float | None], str]] = [
        ("mean train loss (area / steps)", lambda r: mean_loss(r["losses"]), ".3f"),
        ("final train loss (last 20)", lambda r: tail_loss(r["losses"]), ".3f"),
        ("held-out loss", lambda r: r["held_out"], ".3f"),
    ] + [(f"steps to <= {t:g}", lambda r, t=t: first_step_below(r["losses"], t), ".1f") for t in thresholds]
    print("| measure (mean over seeds) | AdamW best (lr) | V4.1 recipe best (lr) | recipe - AdamW | relative |")
    print("|---|---|---|---|---|")
    for label, measure, spec in measures:
        cells = {}
        for name in NAMES:
            options = []
            for lr in sorted({best[c][name] for c in CRITERIA}):
                values = [measure(runs[(name, lr, seed)]) for seed in seeds]
                if all(v is not None for v in values):
                    options.append((statistics.mean(values), lr))
            cells[name] = min(options) if options else None
        a, r = cells["AdamW"], cells["V4.1 recipe"]
        text = {name: "never" if cells[name] is None else f"{cells[name][0]:{spec}} ({cells[name][1]:g})"
                for name in NAMES}
        diff = "n/a" if a is None or r is None else f"{r[0] - a[0]:+{spec}}"
        rel = "n/a" if a is None or r is None else f"{100 * (r[0] - a[0]) / a[0]:+.1f}%"
        print(f"| {label} | {text['AdamW']} | {text['V4.1 recipe']} | {diff} | {rel} |")


def plot(runs: Runs, best: Best, seeds: list[int], floor: float, title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
    colors = {"AdamW": "tab:blue", "V4.1 recipe": "tab:red"}
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1, 1, 1))]
    lrs = sorted({lr for _, lr, seed in runs if seed == 0})
    chosen = {(name, best[c][name]) for c in CRITERIA for name in NAMES}
    for (name, lr, seed), run in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if seed != 0:
            continue
        left.plot(range(1, len(run["losses"]) + 1), smooth(run["losses"]), color=colors[name],
                  linestyle=styles[lrs.index(lr) % len(styles)], linewidth=2.2 if (name, lr) in chosen else 1.0,
                  label=f"{name}, lr {lr:g} (area {mean_loss(run['losses']):.2f}, held-out {run['held_out']:.3f})")
    left.set_title("learning-rate sweep, seed 0 (thick: a best lr)")
    for name, lr in sorted(chosen):
        curves = torch.tensor([smooth(runs[(name, lr, seed)]["losses"]) for seed in seeds])
        steps = range(1, curves.shape[1] + 1)
        held = statistics.mean(runs[(name, lr, seed)]["held_out"] for seed in seeds)
        area = statistics.mean(mean_loss(runs[(name, lr, seed)]["losses"]) for seed in seeds)
        which = ", ".join(c for c in CRITERIA if best[c][name] == lr)
        right.plot(steps, curves.mean(0), color=colors[name], linestyle="-" if best["held-out"][name] == lr else "--",
                   label=f"{name}, lr {lr:g} (best {which}): area {area:.3f}, held-out {held:.3f}")
        if len(seeds) > 1:
            right.fill_between(steps, curves.min(0).values, curves.max(0).values, color=colors[name], alpha=0.15)
    right.set_title(f"best lrs, mean of seeds {', '.join(map(str, seeds))} (band: min-max over seeds)")
    for ax in (left, right):
        ax.axhline(floor, color="gray", linestyle="--", linewidth=1, label=f"bigram entropy rate {floor:.2f}")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    left.set_ylabel("train cross-entropy (10-step mean)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"curves written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 2e-2, 4e-2])
    parser.add_argument("--max-extend", type=int, default=2,
                        help="how many times the sweep may be extended on each side when a best lr is at its edge")
    parser.add_argument("--seeds", type=int, default=3,
                        help="number of seeds (0..N-1) at the best learning rates; seed 0 is the sweep's")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[4.0, 3.0, 2.0, 1.6])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--held-out", type=int, default=64, help="held-out sequences")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default=None,
                        help="JSON file of finished runs: read if present, rewritten after every run (resumable)")
    parser.add_argument("--png", default=str(Path(__file__).with_name("optimizer_recipe_curves.png")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    vocab = tiny_config().text_config.vocab_size
    process = BigramProcess(vocab)
    held_out = process.sample(args.held_out, args.seq, torch.Generator().manual_seed(12345))
    batch_streams: dict[int, list[torch.Tensor]] = {}

    def batches(seed: int) -> list[torch.Tensor]:
        if seed not in batch_streams:
            generator = torch.Generator().manual_seed(1000 + seed)
            batch_streams[seed] = [process.sample(args.batch, args.seq, generator) for _ in range(args.steps)]
        return batch_streams[seed]

    setting = f"steps={args.steps},batch={args.batch},seq={args.seq},warmup={args.warmup},held_out={args.held_out}"
    cache: dict[str, dict] = {}
    if args.cache and Path(args.cache).exists():
        cache = json.loads(Path(args.cache).read_text())
    runs: Runs = {}
    start = time.perf_counter()

    def run(name: str, lr: float, seed: int) -> dict:
        if (name, lr, seed) in runs:
            return runs[(name, lr, seed)]
        key = f"{setting}|{name}|{lr!r}|{seed}"
        if key in cache:
            result, origin = cache[key], "cached"
        else:
            result, origin = train(name != "AdamW", batches(seed), held_out, lr, args.warmup, seed), "ran"
            if args.cache:
                cache[key] = result
                Path(args.cache).write_text(json.dumps(cache))
        runs[(name, lr, seed)] = result
        print(f"[{time.perf_counter() - start:6.0f}s] {name:11s} lr {lr:<8g} seed {seed}: held-out "
              f"{result['held_out']:.3f}, mean train loss {mean_loss(result['losses']):.3f}, "
              f"{result['seconds']:.0f} s ({origin})", flush=True)
        return result

    best: Best = {c: {} for c in CRITERIA}
    for name in NAMES:
        lrs = sorted(args.lrs)
        for lr in lrs:
            run(name, lr, 0)
        added = []
        while True:
            picks = {min(lrs, key=lambda lr: score(runs[(name, lr, 0)], c)) for c in CRITERIA}
            if lrs[-1] in picks and sum(lr > max(args.lrs) for lr in lrs) < args.max_extend:
                new = lrs[-1] * 2
            elif lrs[0] in picks and sum(lr < min(args.lrs) for lr in lrs) < args.max_extend:
                new = lrs[0] / 2
            else:
                break
            lrs = sorted(lrs + [new])
            added.append(new)
            run(name, new, 0)
        for c in CRITERIA:
            best[c][name] = min(lrs, key=lambda lr: score(runs[(name, lr, 0)], c))
            edge = best[c][name] in (lrs[0], lrs[-1])
            print(f"{name}: best lr by {c} {best[c][name]:g} of {', '.join(f'{lr:g}' for lr in lrs)}"
                  + (f" (sweep extended by {', '.join(f'{lr:g}' for lr in added)})" if added else "")
                  + (" -- STILL AT THE EDGE of the sweep" if edge else " (bracketed)"), flush=True)

    seeds = list(range(args.seeds))
    for seed in seeds[1:]:
        for name in NAMES:
            for lr in sorted({best[c][name] for c in CRITERIA}):
                run(name, lr, seed)

    floor = process.entropy_rate()
    print()
    print(f"steps {args.steps}, batch {args.batch}x{args.seq}, warm-up {args.warmup} then cosine to 0.1x, "
          f"threads {args.threads}, held-out {args.held_out}x{args.seq}; bigram entropy rate (loss floor) "
          f"{floor:.3f}; training time of all {len(runs)} runs "
          f"{sum(r['seconds'] for r in runs.values()) / 60:.1f} min, "
          f"this invocation {(time.perf_counter() - start) / 60:.1f} min")
    print()
    print("Sweep (seed 0):")
    print()
    sweep_table(runs, args.thresholds, best)
    done = []
    for c, (meaning, _) in CRITERIA.items():
        print()
        if best[c] in done:
            print(f"Best by {c} ({meaning}): the same learning rates as above.")
            continue
        done.append(best[c])
        print(f"Each optimizer at its best learning rate by {c} ({meaning}):")
        print()
        best_lr_tables(runs, args.thresholds, best[c], seeds)
    print()
    print(f"Best against best: for every measure, each optimizer's best over its chosen learning rates "
          f"({', '.join(CRITERIA)}), as the mean over seeds {', '.join(map(str, seeds))}:")
    print()
    best_vs_best_table(runs, args.thresholds, best, seeds)
    print()
    for (name, lr, seed), result in runs.items():
        if result["balance"] and any(best[c][name] == lr for c in CRITERIA):
            print(f"{name} lr {lr:g} seed {seed}: router max/mean expert load at the last step {result['balance']}")
    plot(runs, best, seeds, floor, f"Tiny DeepSeek-V4.1, random bigram data, batch {args.batch}x{args.seq}, "
         f"{args.steps} steps", args.png)


if __name__ == "__main__":
    main()
