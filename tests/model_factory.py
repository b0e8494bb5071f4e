"""Small random-weight models for tests that need no reference outputs."""

from __future__ import annotations

import json

import torch

from modeling_deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from reference_cases import FIXTURES


def tiny_config(vision: bool = False, **text_overrides) -> DeepseekV41Config:
    """The tiny-text fixture's schedule in the bf16 weight mode (no checkpoint quantization)."""
    raw = json.loads((FIXTURES / ("tiny-vision" if vision else "tiny-text") / "checkpoint" / "config.json").read_text())
    raw.pop("quantization_config")
    raw["text_config"].update(text_overrides)
    return DeepseekV41Config(**raw)


def random_model(config: DeepseekV41Config | None = None, dtype: torch.dtype = torch.float64, seed: int = 0,
                 hc_scale: float = 1.0) -> DeepseekV41ForCausalLM:
    """Random weights with enough spread that attention, routing and mixing all matter."""
    torch.manual_seed(seed)
    model = DeepseekV41ForCausalLM(config or tiny_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 or name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base", "gate.bias")):
                param.normal_(0, param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.5)
        text = model.config.text_config
        vocab = torch.arange(text.vocab_size)
        model.engram_token_map.copy_(vocab % text.engram_compressed_vocab_size)
    return model.to(dtype)
