"""PEFT LoRA on DeepSeek-V4.1's attention and expert projections.

The projections are `DeepseekV41Linear` modules (not `nn.Linear`): PEFT's built-in dispatch does not recognise
them, so `lora_config` registers PEFT's own LoRA `Linear` layer for them through PEFT's custom-module mapping.
That layer only needs `in_features`, `out_features`, a `weight` and a forward, which `DeepseekV41Linear` has in
the bf16 weight mode (dense storage). Quantized (FP8/FP4) weights cannot be merged into: call
`model.dequantize_weights()` before attaching adapters to a hub checkpoint.

Target modules (names as in the hub checkpoint):
- attention: `wq_a`, `wq_b` (query low-rank pair), `wkv` (the shared K=V latent), `wo_b` (output projection).
  `wo_a` is not adaptable: it is applied as a grouped einsum on its weight, not called as a module.
- experts: `w1` (gate), `w3` (up), `w2` (down) of every routed expert `ffn.experts.{E}` and of `ffn.shared_experts`.
"""

from __future__ import annotations

ATTENTION_TARGETS = ("wq_a", "wq_b", "wkv", "wo_b")
EXPERT_TARGETS = ("w1", "w2", "w3")
DEFAULT_TARGET_MODULES = ATTENTION_TARGETS + EXPERT_TARGETS


def target_regex(attention: tuple[str, ...] = ATTENTION_TARGETS, experts: tuple[str, ...] = EXPERT_TARGETS,
                 include_drafter: bool = False) -> str:
    """A PEFT `target_modules` regex for the backbone's main attention and expert projections (not the
    compressor/indexer/Engram projections that share some of these short names; `model.mtp.*` only when asked)."""
    prefix = r"model\.(layers|mtp)" if include_drafter else r"model\.layers"
    parts = []
    if attention:
        parts.append(rf"{prefix}\.\d+\.attn\.({'|'.join(attention)})")
    if experts:
        parts.append(rf"{prefix}\.\d+\.ffn\.(experts\.\d+|shared_experts)\.({'|'.join(experts)})")
    return "^(" + "|".join(parts) + ")$"


def lora_config(r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, target_modules=None, **kwargs):
    """A `peft.LoraConfig` for causal-LM LoRA on DeepSeek-V4.1 that knows how to wrap `DeepseekV41Linear`."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    from modeling_deepseek_v41.kernels.linear import DeepseekV41Linear

    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                        target_modules=target_modules or target_regex(), task_type="CAUSAL_LM", **kwargs)
    if not _peft_wraps_natively(DeepseekV41Linear):
        config._register_custom_module({DeepseekV41Linear: LoraLinear})
    return config


def _peft_wraps_natively(cls) -> bool:
    """PEFT's default dispatch handles torch.nn.Linear subclasses by itself."""
    import torch

    return issubclass(cls, torch.nn.Linear)


def add_lora(model, **kwargs):
    """`peft.get_peft_model(model, lora_config(**kwargs))`, refusing quantized weights with a clear message."""
    from peft import get_peft_model

    if getattr(model, "quantized", False):
        raise ValueError("LoRA needs the bf16 weight mode: call model.dequantize_weights() first.")
    return get_peft_model(model, lora_config(**kwargs))


def load_lora(model, adapter_dir, **kwargs):
    """`peft.PeftModel.from_pretrained` for adapters saved from `add_lora`: the saved LoraConfig does not carry the
    custom-module mapping, so it is registered again before the adapters are attached."""
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora.layer import Linear as LoraLinear

    from modeling_deepseek_v41.kernels.linear import DeepseekV41Linear

    config = LoraConfig.from_pretrained(adapter_dir)
    if not _peft_wraps_natively(DeepseekV41Linear):
        config._register_custom_module({DeepseekV41Linear: LoraLinear})
    return PeftModel.from_pretrained(model, adapter_dir, config=config, **kwargs)
