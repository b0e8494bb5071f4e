"""Peak host memory of LoRA fine-tuning on the frozen FP8/FP4 weights of the embedded default checkpoint (CPU).

Each phase runs in a fresh process (peak resident memory only grows): the process after imports, after loading
the quantized model, and after `steps` Trainer steps of LoRA r=8 on `training.lora.target_regex()` (batch 4 of
24-token texts, gradient checkpointing on and off). The differences are what the model and the training add.

    python benchmarks/lora_memory.py [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "examples" / "default-checkpoint"

PHASE = r"""
import json, resource, sys, tempfile
sys.path.insert(0, {root!r})
import torch
import modeling_deepseek_v41  # noqa: F401
from transformers import AutoModelForCausalLM, AutoProcessor, Trainer, TrainingArguments
phase, steps, checkpointing = {phase!r}, {steps}, {checkpointing}
if phase != "imports":
    model = AutoModelForCausalLM.from_pretrained({checkpoint!r})
if phase == "train":
    import peft
    from training.collator import DeepseekV41TrainingCollator
    from training.data import text_examples
    from training.lora import add_lora
    processor = AutoProcessor.from_pretrained({checkpoint!r})
    peft_model = add_lora(model, r=8)
    data = text_examples(processor.tokenizer, 24)[: 4 * steps]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, use_cpu=True,
                                 report_to="none", save_strategy="no", remove_unused_columns=False,
                                 disable_tqdm=True, gradient_checkpointing=checkpointing, learning_rate=5e-3)
        Trainer(model=peft_model, args=args, train_dataset=data,
                data_collator=DeepseekV41TrainingCollator(processor)).train()
print(json.dumps({{"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def peak_mib(phase: str, steps: int, checkpointing: bool) -> float:
    code = PHASE.format(root=str(ROOT), phase=phase, steps=steps, checkpointing=checkpointing,
                        checkpoint=str(CHECKPOINT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    imports = peak_mib("imports", args.steps, False)
    loaded = peak_mib("load", args.steps, False)
    print(f"| phase | peak RSS (MiB) | added (MiB) |\n|---|---|---|\n| imports | {imports:.0f} | |")
    print(f"| + quantized model loaded | {loaded:.0f} | {loaded - imports:.0f} |")
    for checkpointing in (False, True):
        trained = peak_mib("train", args.steps, checkpointing)
        label = f"+ {args.steps} LoRA r=8 Trainer steps" + (" (gradient checkpointing)" if checkpointing else "")
        print(f"| {label} | {trained:.0f} | {trained - loaded:.0f} |")


if __name__ == "__main__":
    main()
