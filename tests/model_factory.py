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


def schedule_config(text: dict, vision: bool = False) -> DeepseekV41Config:
    """A bf16-mode config from the tiny-text fixture's sizes with another schedule; Engram table sizes derived."""
    from types import SimpleNamespace

    from modeling_deepseek_v41.layers.engram_hashing import engram_table_rows

    raw = json.loads((FIXTURES / "tiny-text" / "checkpoint" / "config.json").read_text())
    raw.pop("quantization_config")
    raw["text_config"].update(text)
    raw["text_config"]["engram_num_embeddings"] = engram_table_rows(SimpleNamespace(**raw["text_config"]))
    return DeepseekV41Config(**raw)


# other schedules than the fixtures': candidates in a ratio-1 pool after two ratio-2 layers, and no candidates
OTHER_SCHEDULES = {
    "ratio2-then-ratio1-candidates": dict(
        num_hidden_layers=6, compress_ratios=[2, 2, 0, 1, 1, 1, 0], kv_source_layer_ids=[0, 3],
        index_source_layer_ids=[0, 3, 5], candidate_source_layer_id=3, candidate_topk_blocks=2,
        candidate_block_size=4, index_topk=4, sliding_window=8, engram_layer_ids=[0, 4],
        dspark_target_layer_ids=[3, 4, 5], num_nextn_predict_layers=1),
    "ratio2-only-no-candidates": dict(
        num_hidden_layers=4, compress_ratios=[2, 2, 2, 2], kv_source_layer_ids=[0, 2], index_source_layer_ids=[0, 2],
        candidate_source_layer_id=None, index_topk=16, sliding_window=4, engram_layer_ids=[3],
        dspark_target_layer_ids=[], num_nextn_predict_layers=0),
}


# the released head and index widths and pool mix (three ratio-2 pools, one ratio-1 pool), small elsewhere
RELEASED_WIDTHS = dict(
    hidden_size=256, num_attention_heads=4, head_dim=512, qk_rope_head_dim=64, q_lora_rank=64, o_groups=2,
    o_lora_rank=32, index_n_heads=2, index_head_dim=128, index_topk=16, sliding_window=128, num_hidden_layers=5,
    compress_ratios=[2, 2, 2, 1, 1, 0], kv_source_layer_ids=[0, 1, 2, 3], index_source_layer_ids=[0, 1, 2, 3],
    candidate_source_layer_id=3, candidate_topk_blocks=4, candidate_block_size=8, engram_layer_ids=[4],
    dspark_target_layer_ids=[4], num_nextn_predict_layers=1, n_routed_experts=2, num_experts_per_tok=1,
    moe_intermediate_size=32)


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
        model.model.engram_token_map.copy_(vocab % text.engram_compressed_vocab_size)
    return model.to(dtype)
