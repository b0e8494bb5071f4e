"""PEFT LoRA on DeepSeek-V4.1's attention and expert projections, in either weight mode.

The projections are `DeepseekV41Linear` modules, which are `torch.nn.Linear` subclasses: PEFT's own dispatch wraps
them, `target_modules` takes the checkpoint's short names, `"all-linear"` finds them, and saved adapters load back
with plain `peft.PeftModel.from_pretrained`. On a quantized model (FP8/FP4 weights, as shipped) the adapters run in
fp32 beside the frozen quantized weights; the quantized linear's backward gives the input gradient (through the
exactly dequantized weight) and no weight gradient, so the base stays bit-identical.

Target modules (names as in the hub checkpoint):
- attention: `wq_a`, `wq_b` (query low-rank pair), `wkv` (the shared K=V latent), `wo_b` (output projection).
  `wo_a` is not a linear layer: the attention applies its weight as a grouped (block-diagonal) einsum.
- experts: `w1` (gate), `w3` (up), `w2` (down) of every routed expert `ffn.experts.{E}` and of `ffn.shared_experts`.
"""

from __future__ import annotations

ATTENTION_TARGETS = ("wq_a", "wq_b", "wkv", "wo_b")
EXPERT_TARGETS = ("w1", "w2", "w3")
DEFAULT_TARGET_MODULES = ATTENTION_TARGETS + EXPERT_TARGETS


def target_regex(attention: tuple[str, ...] = ATTENTION_TARGETS, experts: tuple[str, ...] = EXPERT_TARGETS,
                 include_drafter: bool = False, routed_experts: bool = True) -> str:
    """A PEFT `target_modules` regex for the backbone's main attention and expert projections only (the short names
    alone also match the compressor, indexer and drafter projections that share them; `mtp.*` only when asked).
    Matches with or without a base-model prefix such as `model.`. `routed_experts=False` keeps the shared expert
    only: on a quantized model that leaves the FP8 projections, the ones PEFT's LoHa and LoKr can size (they read
    the stored weight's shape, which for the FP4 routed experts is the packed [out, in/2])."""
    prefix = r"(.*\.)?(layers|mtp)" if include_drafter else r"(.*\.)?layers"
    parts = []
    if attention:
        parts.append(rf"{prefix}\.\d+\.attn\.({'|'.join(attention)})")
    if experts:
        which = r"(experts\.\d+|shared_experts)" if routed_experts else "shared_experts"
        parts.append(rf"{prefix}\.\d+\.ffn\.{which}\.({'|'.join(experts)})")
    return "^(" + "|".join(parts) + ")$"


def lora_config(r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, target_modules=None, **kwargs):
    """A causal-LM `peft.LoraConfig`, by default on the backbone's attention and expert projections."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                      target_modules=target_modules or target_regex(), task_type="CAUSAL_LM", **kwargs)


def add_lora(model, **kwargs):
    """`peft.get_peft_model(model, lora_config(**kwargs))`: works on the quantized (as shipped) and bf16 weight modes."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(**kwargs))


def load_lora(model, adapter_dir, **kwargs):
    """Deprecated (removed in the next release): `peft.PeftModel.from_pretrained(model, adapter_dir, **kwargs)`."""
    import warnings

    from peft import PeftModel

    warnings.warn("training.lora.load_lora is deprecated and will be removed in the next release: use "
                  "peft.PeftModel.from_pretrained(model, adapter_dir), which loads these adapters as they are.",
                  FutureWarning, stacklevel=2)
    return PeftModel.from_pretrained(model, adapter_dir, **kwargs)


def adapter_weights(model, r: int = 8, target_modules: str | None = None) -> int:
    """How many LoRA weights `lora_config(r=r)` adds to `model`: r x (in + out) per matched linear (works on the
    meta device, so it sizes the released model without its weights)."""
    import re

    from torch import nn

    pattern = re.compile(target_modules or target_regex())
    return sum(r * (module.in_features + module.out_features) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and pattern.fullmatch(name))
