"""Distance of the bf16 weight mode from the official reference on the fixtures' tie-free positions.

Run: python benchmarks/weight_modes.py
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import modeling_deepseek_v41  # noqa: E402,F401
from reference_cases import load_case, model_case_dirs  # noqa: E402


def main() -> None:
    for folder in model_case_dirs():
        case = load_case(str(folder))
        model = AutoModelForCausalLM.from_pretrained(folder / "checkpoint", weight_mode="bf16")
        with torch.no_grad():
            logits = model(**case.model_inputs()).logits
        reference = case.expected["logits"]
        distances, agree, count = [], 0, 0
        for row, clean in enumerate(case.expected["clean_prefix"].tolist()):
            mine, ref = logits[row, :clean], reference[row, :clean]
            distances.append((mine - ref).norm(dim=-1) / ref.norm(dim=-1))
            agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
            count += clean
        d = torch.cat(distances)
        print(f"{folder.name}: bf16 mode vs reference: relative L2 median {float(d.median()):.4f}, "
              f"max {float(d.max()):.4f}, top-1 agreement {agree / count:.4f}")


if __name__ == "__main__":
    main()
