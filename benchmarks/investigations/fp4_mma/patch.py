"""`benchmarks/realwidth.py --moe-mma`: the model's decode-sized grouped MoE calls through `finish.mma_moe` over
permuted copies of the packed FP4 expert stacks (made at a stack's first call, an eager step before any graph is
recorded), for an A/B of whole steps. For measuring only: the copies hold the experts a second time."""

from __future__ import annotations

import torch

OPTIONS_KEPT = ("fp8_experts", "fp8_dot", "tile", "k_chunks", "f16_slices", "rows", "grouped_gemm")


def use_mma_moe(max_tokens: int = 256) -> None:
    """Route grouped_moe's packed-FP4 calls of up to max_tokens tokens (without forced formulations) to mma_moe."""
    import modeling_deepseek_v41.kernels.triton as kernels
    from finish import mma_moe
    from fp4_mma import permute_fp4_words

    original = kernels.grouped_moe
    copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def grouped_moe(tokens, experts, weights, w1, s1, w3, s3, w2, s2, limit, **options):
        if (tokens.shape[0] > max_tokens or s1 is None or w1.dtype not in (torch.int8, torch.uint8)
                or any(options.get(name) for name in OPTIONS_KEPT)):
            return original(tokens, experts, weights, w1, s1, w3, s3, w2, s2, limit, **options)
        if w1.data_ptr() not in copies:  # w1 and w3 stacked along N: one launch for both
            copies[w1.data_ptr()] = (permute_fp4_words(torch.cat((w1, w3), dim=1)),
                                     torch.cat((s1.view(torch.uint8), s3.view(torch.uint8)), dim=1),
                                     permute_fp4_words(w2))
        w13, s13, p2 = copies[w1.data_ptr()]
        return mma_moe(tokens, experts, weights, w13, s13, p2, s2, limit, shared=options.get("shared"))

    kernels.grouped_moe = grouped_moe
