"""What loading the hub checkpoint as shipped needs beyond transformers' loader: the Engram token map built from
the folder's tokenizer, and the optional dequantization to bf16."""

from __future__ import annotations

import os

import torch
from torch import nn

from .engram_hashing import build_compressed_token_map


def load_tokenizer_for_token_map(pretrained_model_name_or_path: str | os.PathLike, **hub_kwargs):
    """The checkpoint folder's tokenizer; a clear error when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"The checkpoint at {pretrained_model_name_or_path} carries no Engram token map (engram_token_map), so "
            "it must be built from the checkpoint's tokenizer, but no tokenizer could be loaded from there "
            f"({error}). Put tokenizer.json and tokenizer_config.json next to the weights, or load the tokenizer "
            "yourself and call model.build_engram_token_map(tokenizer)."
        ) from error


def compressed_token_map(tokenizer, vocab_size: int, expected_size: int) -> torch.Tensor:
    """The Engram token map as an int64 tensor [vocab_size], checked against the config's compressed size."""
    mapping, size = build_compressed_token_map(tokenizer)
    if size != expected_size:
        raise ValueError(
            f"The tokenizer compresses to {size} Engram ids but the config's engram_compressed_vocab_size is "
            f"{expected_size}: every hash multiplier depends on it, so this tokenizer does not belong to this model."
        )
    if len(mapping) > vocab_size:
        raise ValueError(f"The tokenizer has {len(mapping)} tokens but the model's vocab_size is {vocab_size}.")
    token_map = torch.zeros(vocab_size, dtype=torch.int64)
    token_map[: len(mapping)] = torch.tensor(mapping, dtype=torch.int64)
    return token_map


def dequantize_module_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Turn every FP8/FP4 weight (and Engram table) into a dense weight of `dtype`, module by module."""
    for module in model.modules():
        dequantize = getattr(module, "dequantize_", None)
        if dequantize is not None:
            dequantize(dtype)
