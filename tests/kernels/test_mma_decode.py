"""The tensor-core decode (Gluon): the routed experts (moe_mma.py around fp4_mma.py's products), the FP8 linears
(fp8_mma.py) and the dense ones (dense_mma.py).

On the CPU: the QDQ into the kernels' order, the MoE's launches around the products in Triton's interpreter with the
products replaced by their dense contract (`_dense_partials`: what fp4_mma_partials must return) against the rows
formulation, the exact three-piece split of fp32 weights the dense kernel relies on, and the dispatch (CUDA tensors
only, switched on). On a GPU: each Gluon kernel against its contract at the released shapes, batch invariance across
row counts and block sizes, pairs, and CUDA-graph capture."""

from __future__ import annotations

import importlib

import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from modeling_deepseek_v41.kernels import numerics  # noqa: E402
from modeling_deepseek_v41.kernels.triton import grouped_moe, mma_choice, moe_mma  # noqa: E402
from modeling_deepseek_v41.kernels.triton.quant import fp8_act_quant  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _mma_columns(k):
    """[K]: the position of each column in common.mma_position's order."""
    c = torch.arange(k)
    return (c // 128) * 128 + 32 * ((c % 32) // 8) + 8 * ((c % 128) // 32) + c % 8


def _dense_partials(x_codes, x_scales, w, scales, pair_of_row, top_k, block_expert, block_start, block_end, k_chunk,
                    block_rows, second=None, prefetch=False):
    """fp4_mma_partials' contract computed densely: per K chunk, each sorted row's product with its expert's
    dequantized weight (columns of the second stack after the first's; `prefetch` changes no value)."""
    if second is not None:
        return torch.cat([_dense_partials(x_codes, x_scales, ww, ss, pair_of_row, top_k, block_expert, block_start,
                                          block_end, k_chunk, block_rows) for ww, ss in ((w, scales), second)], dim=-1)
    e, n, half_k = w.shape
    k = half_k * 2
    x = x_codes[:, _mma_columns(k).to(x_codes.device)].double() * x_scales.double().repeat_interleave(32, dim=1)
    chunk = triton.cdiv(k_chunk, 128) * 128
    rows = pair_of_row.shape[0] if pair_of_row is not None else x_codes.shape[0]
    out = torch.zeros(triton.cdiv(k, chunk), rows, n, dtype=torch.float32, device=x_codes.device)
    for b in range(block_expert.shape[0]):
        start, end = int(block_start[b]), int(block_end[b])
        if start >= end:
            continue
        ex = int(block_expert[b])
        dense = numerics.dequantize_fp4_weight(w[ex], scales[ex], torch.float64)
        for r in range(start, end):
            xr = x[int(pair_of_row[r]) // top_k if pair_of_row is not None else r]
            for s, k0 in enumerate(range(0, k, chunk)):
                out[s, r] = (dense[:, k0:k0 + chunk] @ xr[k0:k0 + chunk]).float()
    return out


def _experts(n_experts, d, inter, seed):
    def make(n, k, s):
        dense = torch.randn(n_experts, n, k, generator=_gen(s)) * 0.05
        packed = [numerics.quantize_fp4_weight(e) for e in dense]
        return torch.stack([p for p, _ in packed]).to(DEVICE), torch.stack([q for _, q in packed]).to(DEVICE)
    return (*make(inter, d, seed), *make(inter, d, seed + 1), *make(d, inter, seed + 2))


def _routing(t, n_experts, top_k, seed):
    experts = torch.rand(t, n_experts, generator=_gen(seed)).topk(top_k, dim=-1).indices
    return experts.to(DEVICE), (torch.rand(t, top_k, generator=_gen(seed + 1)) * 1.5).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activations_quantized_into_the_mma_order_are_the_same_values(dtype):
    x = (torch.randn(3, 384, generator=_gen(1)) * 4).to(dtype).to(DEVICE)
    codes, scales = fp8_act_quant(x, torch.float16)
    moved, moved_scales = fp8_act_quant(x, torch.float16, mma_order=True)
    assert torch.equal(moved_scales, scales)
    assert sorted(_mma_columns(384).tolist()) == list(range(384))
    assert torch.equal(moved[:, _mma_columns(384).to(DEVICE)], codes)
    with pytest.raises(ValueError, match="128-column"):
        fp8_act_quant(x[:, :96], torch.float16, mma_order=True)


@pytest.mark.skipif(CUDA, reason="the CPU checks the launches around the products; the GPU runs the products")
@pytest.mark.parametrize("t", [1, 5])
def test_the_launches_around_the_products_give_the_rows_formulation(monkeypatch, t):
    """mma_moe with the products' contract (split K, sorted rows, a second stack's columns after the first's) gives
    grouped_moe's rows formulation: the same SwiGLU, QDQ of h, rounding and combine, up to fp32 summation order."""
    monkeypatch.setattr(moe_mma, "_mma_partials", _dense_partials)
    monkeypatch.setitem(moe_mma.ROWS_K_CHUNK, "up", 128)  # several splits at these widths
    monkeypatch.setitem(moe_mma.ROWS_K_CHUNK, "down", 128)
    n_experts, d, inter, top_k = 6, 256, 384, 3
    stacks = _experts(n_experts, d, inter, seed=3)
    tokens = (torch.randn(t, d, generator=_gen(4))).to(torch.bfloat16)
    experts, weights = _routing(t, n_experts, top_k, seed=5)
    rows = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, rows=True)
    mma = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True)
    assert mma.shape == rows.shape and mma.dtype == rows.dtype
    assert _rel(mma, rows) < 1e-2  # an fp32 order may move h across an e4m3 rounding step
    assert (mma == rows).float().mean() > 0.99
    shared = torch.randn(t, d, generator=_gen(6)).to(torch.bfloat16)
    with_shared = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True, shared=shared)
    assert torch.equal(with_shared, (mma + shared.float()).to(torch.bfloat16))


def test_the_formulation_is_asked_for_or_switched_on(monkeypatch):
    stacks = _experts(4, 128, 128, seed=7)
    tokens = torch.randn(2, 128, generator=_gen(8)).to(torch.bfloat16).to(DEVICE)
    experts, weights = _routing(2, 4, 2, seed=9)
    with pytest.raises(ValueError, match="mma takes packed FP4"):
        grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True, rows=True)
    with pytest.raises(ValueError, match="pass mma=True with it"):
        grouped_moe(tokens, experts, weights, *stacks, limit=10.0, tile={"prefetch": True})
    calls = []
    monkeypatch.setattr(moe_mma, "_mma_partials", lambda *a, **k: calls.append(1) or _dense_partials(*a, **k))
    monkeypatch.setattr("modeling_deepseek_v41.kernels.triton.moe.mma_moe_enabled", lambda: True)
    grouped_moe(tokens, experts, weights, *stacks, limit=10.0)
    assert len(calls) == (2 if CUDA else 0)  # switched on, CUDA tensors only; the CPU keeps the exact rows
    monkeypatch.setattr(mma_choice, "_chosen", {"moe": False, "linears": False})  # restored after the test
    monkeypatch.setattr(mma_choice, "gluon_available", lambda: False)
    for switch in (mma_choice.use_mma_moe, mma_choice.use_mma_linears):
        with pytest.raises(RuntimeError, match="Gluon"):
            switch(True)
    assert not mma_choice.mma_moe_enabled() and not mma_choice.mma_linears_enabled()


def test_the_experts_switch_defaults_on_where_gluon_is_and_the_environment_decides(monkeypatch):
    """The experts' tensor cores are the default wherever Triton has Gluon, the linears' are not; the environment's
    0 or 1 overrides either, and anything else is refused with the values it takes."""
    monkeypatch.delenv("DEEPSEEK_V41_MMA_MOE", raising=False)
    assert mma_choice._from_environment("DEEPSEEK_V41_MMA_MOE", True) is True
    assert mma_choice._from_environment("DEEPSEEK_V41_MMA_MOE", False) is False
    monkeypatch.setenv("DEEPSEEK_V41_MMA_MOE", "0")
    assert mma_choice._from_environment("DEEPSEEK_V41_MMA_MOE", True) is False
    monkeypatch.setenv("DEEPSEEK_V41_MMA_MOE", "yes")
    with pytest.raises(ValueError, match="DEEPSEEK_V41_MMA_MOE takes 0 \\(off\\) or 1 \\(on\\)"):
        mma_choice._from_environment("DEEPSEEK_V41_MMA_MOE", True)
    monkeypatch.setenv("DEEPSEEK_V41_MMA_MOE", "1")
    monkeypatch.setattr(mma_choice, "gluon_available", lambda: False)
    with pytest.raises(RuntimeError, match="Gluon"):
        mma_choice._from_environment("DEEPSEEK_V41_MMA_MOE", False)
    monkeypatch.undo()
    monkeypatch.setattr(mma_choice, "_chosen", mma_choice._chosen)  # the session's switches, restored after
    monkeypatch.delenv("DEEPSEEK_V41_MMA_MOE", raising=False)
    monkeypatch.delenv("DEEPSEEK_V41_MMA_LINEARS", raising=False)
    importlib.reload(mma_choice)  # the module's own choice, as at import
    assert mma_choice.mma_moe_enabled() == mma_choice.gluon_available() and not mma_choice.mma_linears_enabled()


# --- the Gluon products on the GPU -----------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only")
@pytest.mark.parametrize("e,t", [(8, 1), (32, 6), (32, 32), (384, 32), (32, 256)])
def test_cuda_products_keep_their_contract_at_released_shapes(e, t):
    """At every block size a row's products are its own (8, 16 and 32 rows give the same bits) and equal the dense
    contract up to fp32 summation order; loading each next slice ahead gives the same bits."""
    from modeling_deepseek_v41.kernels.triton.fp4_mma import fp4_mma_partials
    from modeling_deepseek_v41.kernels.triton.moe_schedule import moe_schedule
    n, k, top_k = 2304, 5120, 6
    w1, s1, w3, s3, _, _ = _experts_on_device(e, k, n)
    x = torch.randn(t, k, device=DEVICE).to(torch.bfloat16)
    experts, _ = _routing(t, e, top_k, seed=t)
    codes, xs = fp8_act_quant(x, torch.float16, mma_order=True)
    by_rows = {}
    for block_rows in (8, 16, 32):
        pair_of_row, *blocks, _ = moe_schedule(experts, e, block_rows)
        got = fp4_mma_partials(codes, xs, w1, s1, pair_of_row, top_k, *blocks, 1280, block_rows, second=(w3, s3))
        by_rows[block_rows] = got  # sorted rows: the schedule's order does not depend on the block size
        if block_rows == 8:
            want = _dense_partials(codes, xs, w1, s1, pair_of_row, top_k, *blocks, 1280, block_rows,
                                   second=(w3, s3))
            assert _rel(got.sum(0), want.sum(0)) < 1e-5
            assert all(torch.equal(got, fp4_mma_partials(codes, xs, w1, s1, pair_of_row, top_k, *blocks, 1280,
                                                         block_rows, second=(w3, s3), prefetch=ahead))
                       for ahead in (False, True))
    assert torch.equal(by_rows[8], by_rows[16]) and torch.equal(by_rows[8], by_rows[32])


def _experts_on_device(e, d, inter):
    """Random packed stacks drawn on the GPU (384 experts at the released widths: quantizing them on the CPU is
    slow); scales in [2^-9, 2^0]."""
    def make(n, k):
        return (torch.randint(-128, 128, (e, n, k // 2), device=DEVICE, dtype=torch.int8),
                torch.randint(118, 128, (e, n, k // 32), device=DEVICE, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    return (*make(inter, d), *make(inter, d), *make(d, inter))


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only")
def test_cuda_mma_moe_is_batch_invariant_capturable_and_close_to_the_rows():
    e, d, inter, top_k, t = 32, 5120, 2304, 6, 6
    stacks = _experts_on_device(e, d, inter)
    many = torch.randn(64, d, device=DEVICE).to(torch.bfloat16)  # 64 tokens: blocks of 16 rows, 6 tokens: of 8
    many_experts, many_weights = _routing(64, e, top_k, seed=11)
    tokens, experts, weights = many[:t], many_experts[:t], many_weights[:t]
    full = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True)
    assert torch.equal(grouped_moe(many, many_experts, many_weights, *stacks, limit=10.0, mma=True)[:t], full)
    for i in range(t):
        alone = grouped_moe(tokens[i:i + 1], experts[i:i + 1], weights[i:i + 1], *stacks, limit=10.0, mma=True)
        assert torch.equal(alone, full[i:i + 1])
    rows = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, rows=True)
    assert _rel(full, rows) < 2e-2
    graph = torch.cuda.CUDAGraph()
    out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True)  # compiled before the capture
    with torch.cuda.graph(graph):
        out = grouped_moe(tokens, experts, weights, *stacks, limit=10.0, mma=True)
    graph.replay()
    assert torch.equal(out, full)


# --- the FP8 linears ---------------------------------------------------------------------------------------------

def _fp8(n, k, seed):
    w, s = numerics.quantize_fp8_weight(torch.randn(n, k, generator=_gen(seed)) * 0.02)
    return w.to(DEVICE), s.to(DEVICE)


class _Taken(Exception):
    pass


def test_linears_take_the_tensor_cores_only_on_cuda_when_switched_on(monkeypatch):
    from modeling_deepseek_v41.kernels.triton import fp8_linear, linear, linear_pair

    def taken(*args, **kwargs):
        raise _Taken

    monkeypatch.setattr(linear, "_mma_linear", taken)
    w, s = _fp8(64, 256, seed=1)
    x = torch.randn(40, 256, generator=_gen(2)).to(torch.bfloat16).to(DEVICE)
    for on in (True, False):
        monkeypatch.setattr(linear, "mma_linears_enabled", lambda: on)
        for call in (lambda: fp8_linear(x[:2], w, s), lambda: linear_pair(x[:2], (w, s), (w, s)),
                     lambda: fp8_linear(x, w, s), lambda: linear_pair(x, (w, s), (w, s))):
            if on and CUDA:
                with pytest.raises(_Taken):
                    call()
            else:  # switched off, or on the CPU (the rows kernel and its exact float64 path)
                call()
    monkeypatch.setattr(linear, "mma_linears_enabled", lambda: True)
    fp8_linear(x[:, :96], w[:, :96].contiguous(), s[:, :3])  # K not whole 128-column slices: the rows kernel


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only")
@pytest.mark.parametrize("n,k", [(1024, 5120), (32768, 1024), (5120, 8192), (5120, 2304), (96, 256)])
def test_cuda_fp8_linear_on_tensor_cores_is_the_exact_product_and_batch_invariant(n, k):
    from modeling_deepseek_v41.kernels.triton.fp8_mma import fp8_mma_linear
    w, s = _fp8(n, k, seed=n)
    exact = numerics.dequantize_fp8_weight(w, s).double()
    x = (torch.randn(72, k, generator=_gen(k)) * 3).to(torch.bfloat16).to(DEVICE)
    xq = numerics.fp8_act_qdq(x.float()).double()
    alone = fp8_mma_linear(x[:1], w, s, torch.float32)
    for m in (1, 6, 8, 12, 32, 72):  # 8-, 16- and 32-row programs, several row blocks
        got = fp8_mma_linear(x[:m], w, s, torch.float32)
        assert _rel(got, xq[:m] @ exact.t()) < 1e-5
        assert torch.equal(got[:1], alone)
        assert torch.equal(got[m - 1:m], fp8_mma_linear(x[m - 1:m], w, s, torch.float32))
        assert torch.equal(got, fp8_mma_linear(x[:m], w, s, torch.float32, prefetch=True))  # loads ahead: same bits
    w2, s2 = _fp8(n // 2 + 32, k, seed=n + 1)  # a pair: both products from one launch
    a, b = fp8_mma_linear(x[:3], w, s, torch.float32, second=(w2, s2))
    assert _rel(a, xq[:3] @ exact.t()) < 1e-5
    assert _rel(b, xq[:3] @ numerics.dequantize_fp8_weight(w2, s2).double().t()) < 1e-5


# --- the dense linears: fp32 weights (the head) and bf16 ones -------------------------------------------------------

def test_an_fp32_weight_is_three_bf16_pieces_exactly():
    """dense_mma.py's premise: hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid) sum to w exactly (and every
    piece's product with a bf16 is exact in fp32), for every fp32 of magnitude in [2^-100, 2^127) and zero."""
    bits = torch.randint(-2**31, 2**31 - 1, (2_000_000,), dtype=torch.int32, generator=_gen(3))
    w = torch.cat([bits.view(torch.float32), torch.randn(100_000, generator=_gen(4)) * 0.02, torch.zeros(2)])
    w = w[torch.isfinite(w) & (((w.abs() >= 2.0**-100) & (w.abs() < 2.0**127)) | (w == 0))]
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    assert torch.equal(hi.double() + mid.double() + lo.double(), w.double())
    assert (lo.float().abs() >= 2.0**-126).logical_or(lo == 0).all()  # no subnormal piece for the MMA to flush


def test_dense_weights_take_the_tensor_cores_only_on_cuda_for_their_operand_dtype(monkeypatch):
    from modeling_deepseek_v41.kernels.triton import dense_linear, fp32_linear, linear, linear_pair
    calls = []

    def recorded(rows, w, second=None):
        calls.append((rows.dtype, w.dtype, second is not None))
        out = torch.zeros(rows.shape[0], w.shape[0], device=rows.device,
                          dtype=torch.float32 if w.dtype == torch.float32 else w.dtype)
        return out if second is None else (out, torch.zeros(rows.shape[0], second.shape[0], device=rows.device,
                                                            dtype=out.dtype))

    monkeypatch.setattr(linear, "_dense_mma", recorded)
    monkeypatch.setattr(linear, "mma_linears_enabled", lambda: True)
    w = torch.randn(48, 64, generator=_gen(5)).to(DEVICE)
    x = torch.randn(3, 64, generator=_gen(6)).to(DEVICE)
    dense_linear(x.to(torch.bfloat16), w)  # the head: bf16 rows, fp32 weight
    fp32_linear(x.to(torch.bfloat16), w)
    dense_linear(x, w)  # fp32 rows keep the CUDA cores (they would need more than one bf16 piece)
    dense_linear(x, w.to(torch.bfloat16))  # the bf16 weight mode: rows cast to the weight's dtype
    linear_pair(x, (w.to(torch.bfloat16), None), (w[:32].to(torch.bfloat16), None))
    dense_linear(x[:, :48], w[:, :48].contiguous().to(torch.bfloat16))  # K 48: not whole groups, the rows kernel
    want = [(torch.bfloat16, torch.float32, False)] * 2 + [(torch.bfloat16, torch.bfloat16, False),
                                                          (torch.bfloat16, torch.bfloat16, True)]
    assert calls == (want if CUDA else [])


@pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(129280, 5120), (384, 5120), (100, 96)])
def test_cuda_dense_weights_on_tensor_cores_multiply_exactly_and_batch_invariant(n, k, dtype):
    from modeling_deepseek_v41.kernels.triton.dense_mma import dense_mma_linear
    w = (torch.randn(n, k, device=DEVICE) * 0.02).to(dtype)
    x = torch.randn(72, k, device=DEVICE).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    # fp32 weights: the tensor cores' accumulation (the head, K 5120 in one accumulator: 1.7e-5 on the H100, where
    # 384 x 5120 and 100 x 96 stayed under 1e-6); bf16 weights give bf16 outputs: their rounding
    bound = 5e-5 if dtype == torch.float32 else 4e-3
    alone = dense_mma_linear(x[:1], w)
    for m in (1, 6, 8, 12, 32, 72):
        got = dense_mma_linear(x[:m], w)
        assert _rel(got, exact[:m]) < bound
        assert torch.equal(got[:1], alone)
        assert torch.equal(got[m - 1:m], dense_mma_linear(x[m - 1:m], w))
    a, b = dense_mma_linear(x[:3], w, second=w[: n // 2 + 1].contiguous())
    assert _rel(a, exact[:3]) < bound and _rel(b, exact[:3, : n // 2 + 1]) < bound
