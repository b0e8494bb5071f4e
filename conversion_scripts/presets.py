"""Configs of the random test checkpoints, and the config values derived from the tokenizer and the Engram primes."""

from __future__ import annotations

from types import SimpleNamespace

from modeling_deepseek_v41.layers.engram_hashing import engram_table_rows as model_engram_table_rows

# the tiny-text reference fixture's shape: 8 layers [0,2,2,2,1,1,1,1] + 2 DSpark blocks, D 128
TINY_TEXT = {
    "vocab_size": 512, "hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 32, "q_lora_rank": 64,
    "o_lora_rank": 32, "o_groups": 2, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 65536, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 4096},
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 16,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0], "compress_rope_theta": 160000,
    "kv_source_layer_ids": [1, 4], "index_source_layer_ids": [1, 4, 6], "index_n_heads": 4, "index_head_dim": 64,
    "index_topk": 8, "candidate_source_layer_id": 4, "candidate_topk_blocks": 3, "candidate_block_size": 4,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 3], "engram_max_ngram_size": 4,
    "engram_vocab_size": 1000, "engram_n_heads": 2, "engram_head_dim": 32, "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 2, "dspark_block_size": 5, "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}

# a little wider and deeper, still a few MB
SMALL_TEXT = {
    **TINY_TEXT,
    "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 10,
    "num_attention_heads": 8, "q_lora_rank": 128, "o_lora_rank": 64, "n_routed_experts": 8, "sliding_window": 32,
    "compress_ratios": [0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0], "kv_source_layer_ids": [1, 5],
    "index_source_layer_ids": [1, 5, 7], "index_topk": 16, "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 4, "engram_layer_ids": [1, 4], "engram_vocab_size": 2000,
    "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 32,
}

TINY_VISION = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "patch_size": 14,
    "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 64, "min_pixels": 7056, "max_wh_ratio": None,
}
SMALL_VISION = {**TINY_VISION, "hidden_size": 128, "intermediate_size": 192}

PRESETS = {"tiny": (TINY_TEXT, TINY_VISION), "small": (SMALL_TEXT, SMALL_VISION)}


def engram_table_rows(layer_ids: list[int], max_ngram_size: int, engram_vocab_size: int, n_heads: int) -> list[int]:
    """Rows of each Engram layer's table: the sum of its bucket primes, by the model's own rule."""
    settings = SimpleNamespace(engram_layer_ids=layer_ids, engram_max_ngram_size=max_ngram_size,
                               engram_vocab_size=engram_vocab_size, engram_n_heads=n_heads)
    return model_engram_table_rows(settings)
