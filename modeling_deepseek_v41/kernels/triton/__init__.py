"""Triton kernels for CUDA tensors. Import lazily (it imports triton): the model reaches here only when a CUDA
tensor arrives; the CPU path stays the exact fp32 emulation."""

from .attention import stored_attention
from .byte_sums import byte_sums
from .compress import pool_groups
from .engram_gate import engram_gate
from .engram_hash import engram_rows
from .grouped_linear import grouped_linear
from .index_scores import candidate_scores, index_scores
from .linear import (DECODE_MAX_ROWS, dense_linear, fp4_dequantize, fp4_linear, fp8_dequantize, fp8_linear,
                     fp8_row_linear, fp32_linear, linear_pair)
from .mhc import hc_expand, hc_step
from .moe import MOE_DECODE_MAX_TOKENS, grouped_moe
from .mma_choice import use_mma_linears, use_mma_moe
from .pool_write import pool_step_write
from .quant import fp4_rows, fp4_to_fp8_weight, fp8_act_qdq, fp8_act_quant
from .routing import route, swiglu
from .rows import ring_write, rms_norm, window_kv
from .topk import topk_ascending

__all__ = ["DECODE_MAX_ROWS", "MOE_DECODE_MAX_TOKENS", "byte_sums", "candidate_scores", "dense_linear", "engram_gate",
           "engram_rows", "fp32_linear", "fp4_dequantize", "fp4_linear", "fp4_rows", "fp4_to_fp8_weight",
           "fp8_act_qdq", "fp8_act_quant", "fp8_dequantize", "fp8_linear", "fp8_row_linear", "grouped_linear",
           "grouped_moe", "hc_expand", "hc_step", "index_scores", "linear_pair", "pool_groups", "pool_step_write",
           "ring_write", "rms_norm", "route", "stored_attention", "swiglu", "topk_ascending", "use_mma_linears",
           "use_mma_moe", "window_kv"]
