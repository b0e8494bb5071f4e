"""Does a DSpark verify forward (several tokens at once) round like one-token decode steps on this device?

On the trained default checkpoint, for a few text prompts: greedy generate() with and without drafting (are the
tokens the same?), then, along the plain output, a 6-token cached forward against six one-token cached steps from
the same prefix (largest logit difference and argmax flips).

Run: python benchmarks/dspark_verify_rounding.py [--prompts 3] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.evaluate import text_prompts  # noqa: E402

BLOCK = 6  # a verify forward of the default drafter: the backbone token and 5 drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    checkpoint = ROOT / "examples" / "default-checkpoint"
    model = AutoModelForCausalLM.from_pretrained(checkpoint).to(args.device).eval()
    tokenizer = AutoProcessor.from_pretrained(checkpoint).tokenizer
    for ids in text_prompts(tokenizer, args.prompts):
        ids = ids.to(args.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
        plain = model.generate(ids, **kwargs)
        drafted = model.generate(ids, use_dspark=True, **kwargs)
        worst, flips, total = 0.0, 0, 0
        with torch.no_grad():
            for start in range(ids.shape[1], plain.shape[1] - BLOCK, BLOCK):
                stepped = DeepseekV41Cache(model.config)
                model(plain[:, :start], cache=stepped)
                steps = torch.cat([model(plain[:, t:t + 1], cache=stepped).logits[:, -1]
                                   for t in range(start, start + BLOCK)])
                blocked = DeepseekV41Cache(model.config)
                model(plain[:, :start], cache=blocked)
                block = model(plain[:, start:start + BLOCK], cache=blocked).logits[0]
                worst = max(worst, float((steps - block).abs().max()))
                flips += int((steps.argmax(-1) != block.argmax(-1)).sum())
                total += BLOCK
        print(f"prompt of {ids.shape[1]} tokens: drafted tokens equal plain: {torch.equal(plain, drafted)}; "
              f"{BLOCK}-token forward vs one-token steps: max |logit difference| {worst:.3e}, argmax flips "
              f"{flips}/{total}", flush=True)


if __name__ == "__main__":
    main()
