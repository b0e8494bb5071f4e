"""`benchmarks/realwidth.py --linear-mma`: the model's decode-sized FP8 linears (kernels/triton/linear.py's calls
of rows_linear, one weight or a pair, not the grouped wo_a) through `fp8_mma_linear`, for an A/B of whole steps
and of DSpark's verify: over the weights as they are (the NATURAL order), or over permuted copies made at a
weight's first call (an eager step before any graph is recorded), which hold those weights a second time."""

from __future__ import annotations

import torch


def use_mma_linears(natural: bool = True) -> None:
    from fp8_mma import SLICE, act_quant_permuted, fp8_mma_linear, natural_fp8_rows, permute_fp8_rows
    from modeling_deepseek_v41.kernels.triton import linear
    from modeling_deepseek_v41.kernels.triton.common import FMT_FP8_TILE

    original = linear.rows_linear
    copies: dict[int, torch.Tensor] = {}

    def operand(weight):
        if weight.data_ptr() not in copies:
            copies[weight.data_ptr()] = natural_fp8_rows(weight) if natural else permute_fp8_rows(weight)
        return copies[weight.data_ptr()]

    def rows_linear(x2d, weight, scale, fmt, n, k, out_dtype, groups=1, tile=None, split_target=None, second=None,
                    weight_round=None, quantize=False):
        if fmt != FMT_FP8_TILE or groups != 1 or tile or split_target or k % SLICE or x2d.dtype == torch.float64:
            return original(x2d, weight, scale, fmt, n, k, out_dtype, groups, tile, split_target, second,
                            weight_round, quantize)
        codes, xs = act_quant_permuted(x2d, natural)  # QDQ'd rows give back their own codes (QDQ is idempotent)
        pair = None if second is None else (operand(second[0]), second[1])
        return fp8_mma_linear(codes, xs, operand(weight), scale, out_dtype, second=pair, natural=natural)

    linear.rows_linear = rows_linear
