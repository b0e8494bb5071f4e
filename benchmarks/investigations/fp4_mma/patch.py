"""`benchmarks/realwidth.py --moe-mma`: the model's decode-sized grouped MoE calls through `finish.mma_moe`, for
an A/B of whole steps. The NATURAL order reads the packed FP4 expert stacks as they are; the permuted order
(`--mma-order permuted`) reads permuted copies made at a stack's first call (an eager step before any graph is
recorded), which hold the experts a second time."""

from __future__ import annotations

import torch

OPTIONS_KEPT = ("fp8_experts", "fp8_dot", "tile", "k_chunks", "f16_slices", "rows", "grouped_gemm")


def use_mma_moe(max_tokens: int = 256, natural: bool = True) -> None:
    """Route grouped_moe's packed-FP4 calls of up to max_tokens tokens (without forced formulations) to mma_moe."""
    import modeling_deepseek_v41.kernels.triton as kernels
    from finish import mma_moe
    from fp4_mma import natural_fp4_words, permute_fp4_words

    original = kernels.grouped_moe
    words = natural_fp4_words if natural else permute_fp4_words
    copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def grouped_moe(tokens, experts, weights, w1, s1, w3, s3, w2, s2, limit, **options):
        if (tokens.shape[0] > max_tokens or s1 is None or w1.dtype not in (torch.int8, torch.uint8)
                or any(options.get(name) for name in OPTIONS_KEPT)):
            return original(tokens, experts, weights, w1, s1, w3, s3, w2, s2, limit, **options)
        if w1.data_ptr() not in copies:
            copies[w1.data_ptr()] = (words(w1), words(w3), words(w2))
        p1, p3, p2 = copies[w1.data_ptr()]
        return mma_moe(tokens, experts, weights, p1, s1, p3, s3, p2, s2, limit, shared=options.get("shared"),
                       natural=natural)

    kernels.grouped_moe = grouped_moe
