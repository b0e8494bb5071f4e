"""The MoE's elementwise steps in one launch each: the router (sqrt-softplus scores, biased top-k, normalised
weights) and the clamped SwiGLU between the up and down projections; numerics of `kernels.expert_ops`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs


@triton.jit
def _softplus(x):
    """log(1 + exp(x)), x itself above 20 (torch's threshold); log1p by log(u) * x / (u - 1), u = 1 + exp(x)."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    small = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, small)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, vision_bias_ptr, image_ptr, weights_ptr, experts_ptr, E, top_k,
                  route_scale, BLOCK: tl.constexpr, HAS_IMAGE: tl.constexpr, NORMALIZE: tl.constexpr,
                  ACC: tl.constexpr):
    """One token: scores = sqrt(softplus(logits)); the top_k of scores + bias (bias_vl on image tokens), ties to
    the lower expert id, in descending order; their unbiased scores, normalised, times route_scale."""
    wait_for_inputs()
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    ok = e < E
    scores = tl.sqrt(_softplus(tl.load(logits_ptr + t * E + e, mask=ok, other=0.0).to(ACC)))
    bias = tl.load(bias_ptr + e, mask=ok, other=0.0).to(ACC)
    if HAS_IMAGE:
        image = tl.load(image_ptr + t + e * 0) != 0
        bias = tl.where(image, tl.load(vision_bias_ptr + e, mask=ok, other=0.0).to(ACC), bias)
    biased = tl.where(ok, scores + bias, -float("inf"))
    picked = tl.full([BLOCK], 0.0, ACC)
    total = tl.full([BLOCK], 0.0, ACC)  # the running sum, kept as a vector (scalar tensors trip the interpreter)
    for j in range(top_k):
        best = reduce_max(biased, 0)
        choice = reduce_max(tl.where(biased == best, BLOCK - e, 0), 0)  # the lowest id among the best
        choice = BLOCK - choice
        weight = reduce_sum(tl.where(e == choice, scores, 0.0), 0)
        tl.store(experts_ptr + t * top_k + j + e * 0, choice + e * 0, mask=e == 0)
        picked = tl.where(e == j, weight, picked)
        total += weight
        biased = tl.where(e == choice, -float("inf"), biased)
    if NORMALIZE:
        picked = picked / (total + 1e-20)
    tl.store(weights_ptr + t * top_k + e, picked * route_scale, mask=e < top_k)


def route(logits: torch.Tensor, bias: torch.Tensor, vision_bias: torch.Tensor | None, image_mask: torch.Tensor | None,
          top_k: int, normalize: bool, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k] int64) from router logits [T, E] (sqrt-softplus)."""
    t, e = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    has_image = image_mask is not None and vision_bias is not None
    image = image_mask.reshape(-1).to(torch.int8).contiguous() if has_image else logits
    if t:
        _route_kernel[(t,)](logits, bias, vision_bias if has_image else bias, image, weights, experts, e, top_k,
                            route_scale, BLOCK=max(triton.next_power_of_2(e), top_k), HAS_IMAGE=has_image,
                            NORMALIZE=normalize and top_k > 1,
                            ACC=tl.float64 if logits.dtype == torch.float64 else tl.float32, num_warps=4,
                            **launch_options())
    return weights, experts


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, w_ptr, out_ptr, N, limit, BLOCK: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   HAS_WEIGHTS: tl.constexpr, ACC: tl.constexpr):
    """out = [w *] silu(min(gate, limit)) * clamp(up, -limit, limit) in ACC, rounded to out's dtype."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    gate = tl.load(gate_ptr + r * N + n, mask=ok, other=0.0).to(ACC)
    up = tl.load(up_ptr + r * N + n, mask=ok, other=0.0).to(ACC)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_WEIGHTS:
        h = tl.load(w_ptr + r + n * 0).to(ACC) * h
    tl.store(out_ptr + r * N + n, cast(h, out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """gate, up [..., N] -> [..., N] of out_dtype; weights [..., 1] optional."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n).contiguous(), up.reshape(-1, n).contiguous()
    out = torch.empty(g.shape, dtype=out_dtype, device=gate.device)
    rows = g.shape[0]
    block = 1024
    acc = tl.float64 if gate.dtype == torch.float64 else tl.float32
    w = weights.reshape(-1).contiguous() if weights is not None else g
    if rows:
        _swiglu_kernel[(rows, triton.cdiv(n, block))](g, u, w, out, n, float(limit), BLOCK=block,
                                                      HAS_LIMIT=limit > 0, HAS_WEIGHTS=weights is not None,
                                                      ACC=acc, num_warps=4, **launch_options())
    return out.view(gate.shape)
