"""`from_pretrained`'s `weight_mode` and `dtype=` together: bf16 (the default) keeps the checkpoint's dense dtypes
(bf16 weights, the fp32 parts the reference keeps in fp32); float32/float64 in the bf16 weight mode dequantize
straight to that dtype and cast every floating weight to it; the quantized weight mode keeps the checkpoint's
FP8/FP4 weights and takes float64 (exact-semantics runs) but refuses float32 (it would cast FP8 weights too)."""

from __future__ import annotations

import torch

DENSE_DTYPES = (torch.float32, torch.float64)


def requested_dtype(kwargs: dict):
    """The dtype the caller asked for (`dtype`, or transformers' older `torch_dtype`), None for the default."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype, dtype)
    return None if dtype in (None, "auto", torch.bfloat16) else dtype


def apply_weight_mode(model, kwargs: dict) -> None:
    """After loading: dequantize for the bf16 weight mode, and honour `dtype=` (or refuse it with the reason)."""
    dtype = requested_dtype(kwargs)
    if dtype is not None and dtype not in DENSE_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported: use torch.bfloat16 (the default), torch.float32 or "
                         "torch.float64 (the last two with weight_mode=\"bf16\").")
    if model.config.weight_mode != "bf16":
        if dtype not in (None, torch.float64):  # float64: built so by transformers' default dtype (weight_dtype)
            raise ValueError(f"dtype={dtype} needs weight_mode=\"bf16\": the quantized weight mode keeps the "
                             "checkpoint's FP8/FP4 weights and runs their reference numerics. Load with "
                             f"weight_mode=\"bf16\", dtype={dtype}, or leave dtype out.")
        return
    if model.quantized:
        model.dequantize_weights(dtype or torch.bfloat16)
    if dtype is not None:
        model.to(dtype)
