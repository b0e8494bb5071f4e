"""`benchmarks/realwidth.py --linear-mma`: the model's decode-sized FP8 linears (kernels/triton/linear.py's calls
of rows_linear, one weight or a pair, not the grouped wo_a) through `fp8_mma_linear` over permuted copies of the
weights (made at a weight's first call, an eager step before any graph is recorded), for an A/B of whole steps
and of DSpark's verify. For measuring only: the copies hold those weights a second time."""

from __future__ import annotations

import torch


def use_mma_linears() -> None:
    from fp8_mma import SLICE, fp8_mma_linear, permute_activations, permute_fp8_rows
    from modeling_deepseek_v41.kernels.triton import linear
    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE
    from modeling_deepseek_v41.kernels.triton.quant import fp8_act_quant

    original = linear.rows_linear
    copies: dict[int, torch.Tensor] = {}

    def one(codes, xs, weight, scale, out_dtype):
        if weight.data_ptr() not in copies:
            copies[weight.data_ptr()] = permute_fp8_rows(weight)
        return fp8_mma_linear(codes, xs, copies[weight.data_ptr()], scale, out_dtype)

    def rows_linear(x2d, weight, scale, fmt, n, k, out_dtype, groups=1, tile=None, split_target=None, second=None,
                    weight_round=None, quantize=False):
        if fmt != FMT_FP8_TILE or groups != 1 or tile or split_target or k % SLICE or x2d.dtype == torch.float64:
            return original(x2d, weight, scale, fmt, n, k, out_dtype, groups, tile, split_target, second,
                            weight_round, quantize)
        codes, xs = fp8_act_quant(x2d, torch.float16)  # QDQ'd rows give back their own codes (QDQ is idempotent)
        codes = permute_activations(codes)
        out = one(codes, xs, weight, scale, out_dtype)
        if second is None:
            return out
        w2, s2, _ = second
        return out, one(codes, xs, w2, s2, out_dtype)

    linear.rows_linear = rows_linear
