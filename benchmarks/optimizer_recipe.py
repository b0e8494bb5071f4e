"""The V4.1 optimizer recipe against plain AdamW on a small random model and a fixed random bigram process.

Both runs start from the same weights, see the same batches and use the same learning rate and schedule. The recipe
run uses `create_optimizer` (head-wise Muon / Sinkhorn / AdamW) plus the per-modality bias balancing with its
sequence-level loss; the logged loss is the language-model cross-entropy alone (the balance term is subtracted).

Run: python benchmarks/optimizer_recipe.py [--steps 300] [--lrs 1e-3 3e-3 1e-2] [--threads 2]
Writes benchmarks/optimizer_recipe_curves.png (needs matplotlib) and prints the markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import random_model, tiny_config  # noqa: E402

from modeling_deepseek_v41.expert_balancing import ExpertBalancer  # noqa: E402
from modeling_deepseek_v41.optimizer_recipe import create_optimizer  # noqa: E402


class BigramProcess:
    """A fixed Markov chain over the vocabulary: every token has a handful of likely successors."""

    def __init__(self, vocab: int, successors: int = 4, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -1e9)
        for token in range(vocab):
            chosen = torch.randperm(vocab, generator=generator)[:successors]
            logits[token, chosen] = torch.randn(successors, generator=generator)
        self.probs = logits.softmax(dim=-1)
        self.generator = generator

    def entropy_rate(self) -> float:
        """Mean next-token entropy under the uniform start distribution (the loss floor, near the stationary one)."""
        p = self.probs
        return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())

    def sample(self, batch: int, length: int) -> torch.Tensor:
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.probs.shape[0], (batch,), generator=self.generator)
        for t in range(1, length):
            tokens[:, t] = torch.multinomial(self.probs[tokens[:, t - 1]], 1, generator=self.generator).squeeze(1)
        return tokens


def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(recipe: bool, batches: list[torch.Tensor], held_out: torch.Tensor, lr: float, warmup: int) -> dict:
    model = random_model(tiny_config(), dtype=torch.float32).train()
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


def first_step_below(values: list[float], threshold: float) -> str:
    for step, value in enumerate(smooth(values)):
        if value <= threshold:
            return str(step + 1)
    return "never"


def report(runs: dict[tuple[str, float], dict]) -> None:
    print("| optimizer | lr | loss @50 | loss @100 | loss @200 | final train loss (last 20) | held-out loss | "
          "steps to loss <= 4.0 | steps to loss <= 3.0 | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, lr), run in runs.items():
        s = smooth(run["losses"])
        at = [f"{s[min(k, len(s)) - 1]:.3f}" for k in (50, 100, 200)]
        tail = sum(run["losses"][-20:]) / len(run["losses"][-20:])
        print(f"| {name} | {lr:g} | {' | '.join(at)} | {tail:.3f} | {run['held_out']:.3f} | "
              f"{first_step_below(run['losses'], 4.0)} | {first_step_below(run['losses'], 3.0)} | "
              f"{run['seconds']:.0f} |")


def plot(runs: dict[tuple[str, float], dict], floor: float, title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = {"AdamW": "tab:blue", "V4.1 recipe": "tab:red"}
    styles = ["-", "--", ":", "-."]
    lrs = sorted({lr for _, lr in runs})
    for (name, lr), run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), smooth(run["losses"]), color=colors[name],
                linestyle=styles[lrs.index(lr) % len(styles)],
                label=f"{name}, lr {lr:g} (held-out {run['held_out']:.2f})")
    ax.axhline(floor, color="gray", linestyle="--", linewidth=1, label=f"bigram entropy rate {floor:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train cross-entropy (10-step mean)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"curves written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--png", default=str(Path(__file__).with_name("optimizer_recipe_curves.png")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    vocab = tiny_config().text_config.vocab_size
    process = BigramProcess(vocab)
    batches = [process.sample(args.batch, args.seq) for _ in range(args.steps)]
    held_out = process.sample(32, args.seq)
    runs = {}
    for lr in args.lrs:
        runs[("AdamW", lr)] = train(False, batches, held_out, lr, args.warmup)
        runs[("V4.1 recipe", lr)] = train(True, batches, held_out, lr, args.warmup)
        print(f"lr {lr:g} done", flush=True)

    floor = process.entropy_rate()
    print(f"steps {args.steps}, batch {args.batch}x{args.seq}, warm-up {args.warmup} then cosine to 0.1x, "
          f"threads {args.threads}; bigram entropy rate (loss floor) {floor:.3f}")
    report(runs)
    for (name, lr), run in runs.items():
        if run["balance"]:
            print(f"{name} lr {lr:g}: router max/mean expert load at the last step {run['balance']}")
    plot(runs, floor, f"Tiny DeepSeek-V4.1, random bigram data, batch {args.batch}x{args.seq}", args.png)


if __name__ == "__main__":
    main()
