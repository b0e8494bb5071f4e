"""Fine-tune a DeepSeek-V4.1 checkpoint with Transformers' Trainer on the CPU or a GPU.

    python -m training.finetune --checkpoint DIR --mode full|lora|drafter --out OUT [--steps N] [--batch N]
        [--lr X] [--gradient-checkpointing] [--moe-aux-loss-coef X] [--data shapes|text|mixed]

- full: every backbone parameter (the drafter is left out: its own stage is `drafter`), causal-LM loss on the
  answers of the chat examples and on every token of the text examples, plus the optional MoE balance loss.
- lora: PEFT LoRA adapters on the attention (wq_a, wq_b, wkv, wo_b) and expert (w1, w2, w3) projections; the
  adapters are saved to OUT (load them with peft.PeftModel.from_pretrained).
- drafter: the DSpark drafter (mtp.*) only, backbone frozen, with the DSpark objective.

The checkpoint is loaded in the bf16 weight mode (hub FP8/FP4 weights are dequantized). The model is trained in
fp32 on the CPU; full and drafter runs save with save_pretrained to OUT (the native bf16 layout; convert it
back to the hub layout with `python -m conversion_scripts.convert_native_to_hub`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def load_for_training(checkpoint, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoProcessor

    import modeling_deepseek_v41  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(checkpoint, weight_mode="bf16")
    stored = {name: param.dtype for name, param in model.named_parameters()}
    model = model.to(dtype) if dtype is not None else model
    return model, AutoProcessor.from_pretrained(checkpoint), stored


def dataset(kind: str, processor, count: int, seed: int):
    from .data import text_examples
    from .datasets import MixedDataset, ShapeQADataset

    qa = ShapeQADataset(count, seed)
    if kind == "shapes":
        return qa
    texts = text_examples(processor.tokenizer, 64)
    return texts if kind == "text" else MixedDataset(qa, texts, 3)


def main(argv=None) -> int:
    from transformers import TrainingArguments

    from .collator import DeepseekV41TrainingCollator

    summary, _, details = __doc__.strip().partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--mode", choices=("full", "lora", "drafter"), default="full")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None, help="default 1e-4 full, 1e-3 lora and drafter")
    parser.add_argument("--data", choices=("shapes", "text", "mixed"), default="mixed")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--moe-aux-loss-coef", type=float, default=0.0)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, processor, stored = load_for_training(args.checkpoint)
    lr = args.lr or (1e-4 if args.mode == "full" else 1e-3)
    train = dataset(args.data, processor, args.steps * args.batch, args.seed + 100)
    collator = DeepseekV41TrainingCollator(processor)
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), logging_steps=5,
        save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=args.seed,
        remove_unused_columns=False, gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
    )
    if args.mode == "drafter":
        from .drafter import DSparkDrafterTrainer, freeze_all_but_drafter

        freeze_all_but_drafter(model)
        trainer = DSparkDrafterTrainer(model=model, args=training_args, train_dataset=train, data_collator=collator)
    else:
        from .lm import DeepseekV41Trainer

        if args.mode == "lora":
            from .lora import add_lora

            model = add_lora(model, r=args.lora_rank, lora_alpha=2 * args.lora_rank)
            model.print_trainable_parameters()
        else:
            model.dspark.requires_grad_(False)
        trainer = DeepseekV41Trainer(model=model, args=training_args, train_dataset=train, data_collator=collator,
                                     moe_aux_loss_coef=args.moe_aux_loss_coef)
    trainer.train()
    shutil.rmtree(args.out / "trainer", ignore_errors=True)
    if args.mode == "lora":
        model.save_pretrained(args.out)
    else:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.data = param.data.to(stored[name])
        model.save_pretrained(args.out)
    processor.save_pretrained(args.out)
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
