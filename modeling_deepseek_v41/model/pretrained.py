"""The transformers integration shared by the DeepSeek-V4.1 models: weight initialisation, `from_pretrained` (the
ordered steps of `loading/pipeline.py`; the model is built once, by transformers) and the two hooks transformers'
loader calls back, saving, resizing and dequantizing."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel, initialization as init

from ..config.configuration_deepseek_v41 import DeepseekV41Config
from ..kernels.linear import STORAGE_FP4, STORAGE_FP8
from ..kernels.numerics import quantize_fp4_weight, quantize_fp8_weight
from ..layers.block import DeepseekV41Block
from ..layers.engram import DeepseekV41Engram, DeepseekV41EngramTable
from ..layers.engram_hashing import default_token_map
from ..layers.linear import DeepseekV41RMSNorm, DeepseekV41Weight
from ..loading import loader
from ..loading.parameter_count import logical_num_parameters
from ..loading.pipeline import LoadRequest, load_pretrained


class DeepseekV41PreTrainedModel(PreTrainedModel):
    """Weight initialisation and the transformers integration shared by the DeepSeek-V4.1 models."""

    config_class = DeepseekV41Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV41BackboneBlock", "DeepseekV41DSparkBlock"]
    _keys_to_ignore_on_load_missing = [r"(^|\.)engram_token_map$"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.text_config.initializer_range
        if isinstance(module, DeepseekV41Weight):
            if module.storage in (STORAGE_FP8, STORAGE_FP4):
                quantize = quantize_fp8_weight if module.storage == STORAGE_FP8 else quantize_fp4_weight
                weight, scale = quantize(torch.randn(module.out_features, module.in_features) * std)
                init.copy_(module.weight, weight)
                init.copy_(module.scale, scale)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV41EngramTable):
            if module.quantized:
                values = torch.randn(module.weight.shape) * std
                init.copy_(module.weight, values.to(torch.float8_e4m3fn))
                init.copy_(module.scale, torch.ones(module.scale.shape, dtype=torch.float8_e8m0fnu))
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41Block):
            for sublayer in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{sublayer}_fn"), mean=0.0, std=std)
                init.zeros_(getattr(module, f"hc_{sublayer}_base"))
                init.ones_(getattr(module, f"hc_{sublayer}_scale"))
            init.zeros_(module.attn.attn_sink)
            init.normal_(module.ffn.gate.weight, mean=0.0, std=std)
            init.zeros_(module.ffn.gate.bias)
            if module.ffn.gate.bias_vl is not None:
                init.zeros_(module.ffn.gate.bias_vl)
        elif isinstance(module, DeepseekV41PreTrainedModel):
            if hasattr(module, "engram_token_map"):
                text = self.config.text_config
                init.copy_(module.engram_token_map,
                           default_token_map(module.engram_token_map.numel(), text.engram_compressed_vocab_size))
            for name in ("image_start", "image_end", "image_newline"):
                if hasattr(module, name):
                    init.normal_(getattr(module, name), mean=0.0, std=std)

    # -- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, check_finite: bool = True, **kwargs):
        """transformers' loader, plus what the hub checkpoint needs: a checkpoint without the DSpark drafter loads
        without it, the checkpoint is checked against the built model before any weight is read, the CSA2-aware
        `device_map="auto"`, tensor parallelism (`tp_plan`, or `distributed_config` with a tp_plan), Engram tables
        kept in host memory or mapped, the Engram token map built from the folder's tokenizer when the weights do
        not carry it (the released checkpoint), `weight_mode="bf16"` dequantization after loading, and the loaded
        weights checked for NaN/Inf unless `check_finite=False`. The steps, in order: `loading/pipeline.py`."""
        request = LoadRequest(cls, pretrained_model_name_or_path, model_args, kwargs, super().from_pretrained,
                              check_finite)
        return load_pretrained(request)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' resizing of the embedding (and head), in the bf16 weight mode; the Engram token map
        follows: added ids get the default entries (id modulo the compressed vocabulary) until
        `build_engram_token_map(tokenizer)`."""
        if self.quantized:
            raise ValueError(
                "resize_token_embeddings needs the bf16 weight mode: this model holds the checkpoint's FP8/FP4 "
                "weights, which are for inference and cannot be trained, and new token rows must be trained. Load it "
                "with from_pretrained(..., weight_mode=\"bf16\") (or call model.dequantize_weights()) first."
            )
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        base = self.base_model
        if hasattr(base, "engram_token_map"):
            token_map, vocab = base.engram_token_map, embeddings.weight.shape[0]
            added = default_token_map(vocab, self.config.text_config.engram_compressed_vocab_size,
                                      start=min(token_map.numel(), vocab)).to(token_map.device)
            base.register_buffer("engram_token_map", torch.cat([token_map[:vocab], added]))
        return embeddings

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """Check the checkpoint against the model transformers built (names, shapes, dtypes from the headers)
        before transformers reads any weight."""
        loader.check_checkpoint(model, load_config.pretrained_model_name_or_path,
                                load_config.ignore_mismatched_sizes)
        return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args,
                                                      **kwargs)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        elsewhere = loader.read_elsewhere(self, set(loading_info.unexpected_keys))
        if elsewhere:
            loading_info.unexpected_keys = {k for k in loading_info.unexpected_keys if k not in elsewhere}

    def save_pretrained(self, save_directory, *args, save_original_format: bool = False, **kwargs):
        """transformers' save_pretrained, with the tensors named as in `state_dict()` by default: every loader
        (from_pretrained, Trainer's resume, accelerate's load_checkpoint_and_dispatch, load_state_dict) then reads
        them back as they are. `save_original_format=True` writes the hub's names (`embed.weight`, `head.weight`)."""
        loader.check_savable(self)
        return super().save_pretrained(save_directory, *args, save_original_format=save_original_format, **kwargs)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        return logical_num_parameters(self, only_trainable, exclude_embeddings)

    def dequantize_weights(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Switch to the bf16 weight mode: dequantize every FP8/FP4 weight exactly, drop the scales, and drop the
        checkpoint's quantization description from the config (saving then writes dense weights)."""
        loader.dequantize_module_weights(self, dtype)
        self.base_model.quantized = False
        self.config.checkpoint_quantization = None
        self.config.weight_mode = "bf16"
