"""The fused decode kernels (mHC steps, attention from the cache's packed storage) against the ops' exact paths.

Every GPU formulation computes the reference's math: run in float64 (Triton's interpreter on the CPU, the same
program the GPU compiles) it equals the exact path to 1e-10 relative; in the model's dtypes it stays within fp32
summation order of it (bf16 roundings land on the same side but where a sum's order moves a value across a
rounding boundary). Without a GPU the kernels run in the interpreter on small shapes, with one the same checks run
compiled.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined, so before the kernel modules load

from modeling_deepseek_v41.kernels import mhc  # noqa: E402
from modeling_deepseek_v41.kernels import numerics  # noqa: E402
from modeling_deepseek_v41.kernels.numerics import fp4_quantize_rows, fp8_quantize_rows  # noqa: E402
from modeling_deepseek_v41.kernels.sparse_attention import StoredPool, StoredWindow, attend_stored  # noqa: E402
from modeling_deepseek_v41.kernels.triton import fp4_rows, hc_expand, hc_step, stored_attention  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
EXACT = 1e-10  # float64: the same math, only the summation order differs
# float64 checks the math in the interpreter; compiled, the kernels run the model's dtypes
DTYPES = [torch.bfloat16] if CUDA else [torch.float64, torch.bfloat16]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm()).item()


class _Norm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        return (self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def _hc_case(dtype: torch.dtype, rows: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    hc = 4
    streams = torch.randn(1, rows, hc, dim, generator=g).to(dtype)
    read = torch.rand(1, rows, hc, generator=g).to(acc)
    fn = (torch.randn(24, hc * dim, generator=g) * (hc * dim) ** -0.5).to(acc)
    scale, base = (torch.rand(3, generator=g) + 0.5).to(acc), torch.randn(24, generator=g).to(acc)
    norm = _Norm((torch.rand(dim, generator=g) + 0.5).to(dtype), 1e-20)
    output = torch.randn(1, rows, dim, generator=g).to(dtype)
    written = mhc.HyperMix(torch.rand(1, rows, hc, generator=g).to(acc),
                           2 * torch.rand(1, rows, hc, generator=g).to(acc),
                           torch.rand(1, rows, hc, hc, generator=g).to(acc))
    mix = mhc.MixWeights(fn, scale, base, 20, 1e-6, 1e-20)
    return streams, read, mix, norm, output, written


def _on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.fixture(params=["decode", "decode_fp32_dot", "prefill", "prefill_narrow"])
def hc_regime(request, monkeypatch):
    """hc_step's tiles whatever the call's row count: decode's (the projection as three bf16 dots or one fp32 dot),
    prefill's, or prefill's with narrower column splits."""
    from modeling_deepseek_v41.kernels.triton import mhc as hc_kernels
    if request.param.startswith("prefill"):
        monkeypatch.setattr(hc_kernels, "DECODE_ROWS", 0)
    monkeypatch.setattr(hc_kernels, "PREFILL_BLOCK_D", 32 if request.param == "prefill_narrow" else 64)
    monkeypatch.setattr(hc_kernels, "SPLIT_DOT", request.param != "decode_fp32_dot")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_step_computes_the_exact_mhc_math(dtype, hc_regime):
    streams, read, mix, norm, output, written = _hc_case(dtype, rows=3, dim=256)
    with torch.no_grad():
        new_ref = mhc.hc_expand(output, streams, written.post, written.comb)
        mixes_ref, x_ref = mhc.hc_read(new_ref, written.pre, mix, norm)
        args = _on_device(streams, written.pre, mix.fn, mix.scale, mix.base, norm.weight)
        new, pre, post, comb, x = hc_step(*args, 20, 1e-6, 1e-20, 1e-20, *_on_device(output, written.post,
                                                                                     written.comb))
        expanded = hc_expand(*_on_device(output, streams, written.post, written.comb))
    # the expansion has no reduction long enough to round differently (compiled, its multiply-adds may fuse: one
    # rounding step at most); the mixes sum 4*D products
    for got in (new, expanded):
        if CUDA:
            assert ((got.cpu().double() - new_ref.double()).abs() <= new_ref.double().abs() * 2.0**-7).all()
        else:
            assert torch.equal(got, new_ref)
    bound = EXACT if dtype == torch.float64 else 1e-6
    for got, ref in ((pre, mixes_ref.pre), (post, mixes_ref.post), (comb, mixes_ref.comb)):
        assert _rel(got, ref) <= bound
    if dtype == torch.float64:
        assert _rel(x, x_ref) <= EXACT
    else:  # bf16 outputs: at most a few values one bf16 step away where an fp32 statistic rounds differently
        assert (x.cpu().float() - x_ref.float()).abs().max() <= 2.0**-7 * x_ref.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_hc_read_without_expansion_and_with_rows_past_a_block(dtype, hc_regime):
    streams, read, mix, norm, _, _ = _hc_case(dtype, rows=19, dim=200, seed=1)
    with torch.no_grad():
        mixes_ref, x_ref = mhc.hc_read(streams, read, mix, norm)
        _, pre, post, comb, x = hc_step(*_on_device(streams, read, mix.fn, mix.scale, mix.base, norm.weight), 20, 1e-6,
                                        1e-20, 1e-20)
    for got, ref in ((pre, mixes_ref.pre), (post, mixes_ref.post), (comb, mixes_ref.comb), (x, x_ref)):
        assert _rel(got, ref) <= (EXACT if dtype == torch.float64 else 4e-3)


def _stored_case(dtype: torch.dtype, batch: int, seq: int, heads: int, dim: int, window: int, slots: int,
                 pool_rows: int, topk: int, start: int, seed: int = 0):
    """A cache-like ring and pool holding positions 0 .. start + seq - 1, and queries at start .. start+seq-1."""
    g = torch.Generator().manual_seed(seed)
    length = start + seq
    ring_values = torch.randn(batch, slots, dim, generator=g)
    ring_codes, ring_scales = fp8_quantize_rows(ring_values)
    ring_positions = torch.full((batch, slots), -1, dtype=torch.long)
    for p in range(max(0, length - slots), length):
        ring_positions[:, p % slots] = p
    pool_codes, pool_scales = fp4_quantize_rows(torch.randn(batch, pool_rows, dim, generator=g), 16, "e4m3")
    ring = StoredWindow(ring_codes.view(torch.uint8), ring_scales.view(torch.uint8), ring_positions, window)
    pool = StoredPool(pool_codes, pool_scales.to(torch.float8_e4m3fn).view(torch.uint8))
    positions = (start + torch.arange(seq)).repeat(batch, 1)
    positions[0, 0] = -1 if seq > 1 else positions[0, 0]  # a padded query outputs zeros
    selected = torch.stack([torch.randperm(pool_rows, generator=g)[:topk].sort().values for _ in range(batch * seq)])
    selected = selected.view(batch, seq, topk)
    selected[..., -3:] = -1  # fewer rows than the selection's width
    if seq > 1:
        selected[0, 0] = -1  # the padded query sees no pool row either
    q = torch.randn(batch, seq, heads, dim, generator=g).to(dtype)
    angles = positions.clamp_min(0).unsqueeze(-1).float() * torch.rand(8, generator=g)
    rotation = torch.polar(torch.ones_like(angles), angles)
    sink = torch.randn(heads, generator=g)
    return q, rotation, positions, ring, pool, selected, sink


# bf16: the reference's online softmax rounds each block's probabilities against its running max, so the blocks
# must be the reference's (64 entries of the window-then-pool list); a block layout of its own moves a bf16 result
# by about 1e-3 (measured 1.2e-3 with the pool starting in a new block), where only fp32 summation order is left
BF16_ATTENTION = 1e-4 if DEVICE == "cpu" else 4e-3  # CUDA: bf16 tensor-core dots, not yet measured tighter


@pytest.fixture(params=["decode", "decode_split", "wide_decode", "prefill", "prefill_tables"])
def launch(request, monkeypatch):
    """The stored attention's regime whatever the call's row count: the decode tiles (the first launch's blocks
    whole or split in 16-entry programs), a batch's decode tiles, the prefill tiles (every head in one program of
    the second launch), or those reading the ring and pool as dequantized tables."""
    from modeling_deepseek_v41.kernels.triton import attention
    monkeypatch.setattr(attention, "PREFILL_MIN_ROWS", 1 << 62 if "decode" in request.param else 1)
    monkeypatch.setattr(attention, "WIDE_DECODE_ROWS", 1 if request.param == "wide_decode" else 1 << 62)
    monkeypatch.setattr(attention, "DECODE_TILES", dataclasses.replace(
        attention.DECODE_TILES, logit_entries=16 if request.param == "decode_split" else 64))
    monkeypatch.setattr(attention, "PREFILL_TABLES", request.param == "prefill_tables")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [5, 150])  # a ring still filling, and one that wrapped
@pytest.mark.parametrize("window,width", [(96, 96), (128, 41)])  # blocks where the window ends and the pool begins
def test_stored_attention_computes_the_exact_attention(dtype, start, window, width, launch):
    q, rotation, positions, ring, pool, selected, sink = _stored_case(
        dtype, batch=2, seq=2, heads=3, dim=128, window=window, slots=192, pool_rows=100, topk=70, start=start)
    ring = ring._replace(width=width)  # a growing cache lists min(window, its length) entries
    floor = torch.tensor([0, start - 20]) if start > 20 else None
    with torch.no_grad():
        ref = attend_stored(q, rotation, 16, positions, window, floor, ring, pool, selected, sink, 0.09)
        dev = lambda t: t.to(DEVICE)  # noqa: E731
        out = stored_attention(dev(q), dev(rotation), 16, dev(positions), None if floor is None else dev(floor),
                               window, StoredWindow(*map(dev, ring[:3]), ring.width), StoredPool(*map(dev, pool)),
                               dev(selected), dev(sink), 0.09)
    assert _rel(out, ref) <= (EXACT if dtype == torch.float64 else BF16_ATTENTION)
    assert (out[0, 0].abs().max() == 0) == (positions[0, 0] < 0)


def test_every_attention_regime_sums_the_logits_in_the_same_chunks():
    """The tile sets may differ in how much work a program takes, not in a sum's order (batch invariance)."""
    from modeling_deepseek_v41.kernels.triton import attention
    tiles = (attention.DECODE_TILES, attention.WIDE_DECODE_TILES, attention.PREFILL_TILES)
    assert len({t.qk_chunk for t in tiles}) == 1
    assert all(attention.BLOCK_ENTRIES % t.logit_entries == 0 for t in tiles)


@pytest.mark.skipif(not CUDA, reason="bit-for-bit equality across launch shapes is a property of the compiled "
                    "kernels; the interpreter's dots are numpy's, whose summation order follows the shapes")
@pytest.mark.parametrize("regime", ["wide_decode", "prefill"])
def test_a_decode_row_does_not_depend_on_the_call_rows(regime):
    """A batch's rows (the wide decode tiles, or the prefill tiles past PREFILL_MIN_ROWS rows) give each row what a
    one-row call (the narrow tiles) gives it, bit for bit, at the released head count and width: batched decoding
    and DSpark's verify stay exactly greedy."""
    from modeling_deepseek_v41.kernels.triton import attention
    seq = attention.WIDE_DECODE_ROWS // 2 if regime == "wide_decode" else attention.PREFILL_MIN_ROWS // 2
    q, rotation, positions, ring, pool, selected, sink = _stored_case(
        torch.bfloat16, batch=2, seq=seq, heads=64, dim=512, window=128, slots=256, pool_rows=700, topk=512,
        start=300)
    dev = lambda t: t.to(DEVICE)  # noqa: E731

    def attend(b, s):
        with torch.no_grad():
            return stored_attention(dev(q[b, s]), dev(rotation[b, s]), 16, dev(positions[b, s]), None, 128,
                                    StoredWindow(*(dev(t[b]) for t in ring[:3]), ring.width),
                                    StoredPool(*(dev(t[b]) for t in pool)), dev(selected[b, s]), dev(sink), 0.04)
    batch = attend(slice(None), slice(None))
    for b, s in ((0, 1), (1, 0), (1, seq - 1)):
        assert torch.equal(attend(slice(b, b + 1), slice(s, s + 1))[0, 0], batch[b, s])


def test_prefill_tables_read_the_same_entries_bit_for_bit(monkeypatch):
    """The prefill regime's dequantized tables hold exactly the values the packed reads unpack: the same output bit
    for bit (so the choice between them is one of speed only)."""
    from modeling_deepseek_v41.kernels.triton import attention
    q, rotation, positions, ring, pool, selected, sink = _stored_case(
        torch.bfloat16, batch=2, seq=3, heads=3, dim=128, window=96, slots=192, pool_rows=100, topk=70, start=150)
    args = [t.to(DEVICE) for t in (q, rotation)] + [16, positions.to(DEVICE), None, 96,
                                                    StoredWindow(*(t.to(DEVICE) for t in ring[:3]), ring.width),
                                                    StoredPool(*(t.to(DEVICE) for t in pool)), selected.to(DEVICE),
                                                    sink.to(DEVICE), 0.09]
    monkeypatch.setattr(attention, "PREFILL_MIN_ROWS", 1)
    outputs = []
    for tables in (False, True):
        monkeypatch.setattr(attention, "PREFILL_TABLES", tables)
        with torch.no_grad():
            outputs.append(stored_attention(*args))
    assert torch.equal(*outputs)


@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_stored_attention_without_a_pool_and_a_short_listing(dtype, launch):
    q, rotation, positions, ring, pool, selected, sink = _stored_case(
        dtype, batch=1, seq=1, heads=17, dim=64, window=128, slots=192, pool_rows=8, topk=4, start=40)
    ring = ring._replace(width=41)  # a growing cache lists min(window, its length) entries
    with torch.no_grad():
        ref = attend_stored(q, rotation, 16, positions, 128, None, ring, None, None, sink, 0.1)
        out = stored_attention(*(t.to(DEVICE) for t in (q, rotation)), 16, positions.to(DEVICE), None, 128,
                               StoredWindow(*(t.to(DEVICE) for t in ring[:3]), ring.width), None, None,
                               sink.to(DEVICE), 0.1)
    assert _rel(out, ref) <= (EXACT if dtype == torch.float64 else BF16_ATTENTION)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernels_compute_the_exact_ops(dtype):
    """RMSNorm, the window entry (norm, RoPE, FP8 QDQ), the router and the SwiGLU: one launch each."""
    from modeling_deepseek_v41.kernels import expert_ops
    from modeling_deepseek_v41.kernels.sparse_attention import window_kv as exact_window_kv
    from modeling_deepseek_v41.kernels.triton import rms_norm, route, swiglu, window_kv

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 128, generator=g) * 3).to(dtype)
    norm = _Norm((torch.rand(128, generator=g) + 0.5).to(dtype), 1e-6)
    angles = torch.rand(5, 8, generator=g) * 7
    rotation = torch.polar(torch.ones_like(angles), angles)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    bound = EXACT if dtype == torch.float64 else 0.0
    with torch.no_grad():
        assert _rel(rms_norm(dev(x), dev(norm.weight), 1e-6), norm(x)) <= max(bound, 2.0**-8)
        ref = exact_window_kv(x, norm, rotation, 16)
        out = window_kv(dev(x), dev(norm.weight), 1e-6, dev(rotation), 16)
        # the QDQ'd values are on the e4m3 grid: equal, but where a last-bit difference of the norm moves one across
        assert (out.cpu() != ref).double().mean() <= (0.0 if dtype == torch.float64 else 0.02)
        logits = torch.randn(7, 48, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        logits[0, :4] = logits[0, 4]  # ties go to the lower expert id
        bias, vision_bias = torch.randn(48, generator=g) * 0.1, torch.randn(48, generator=g) * 0.1
        image = torch.tensor([0, 1, 0, 0, 1, 1, 0], dtype=torch.bool)
        ref_w, ref_e = expert_ops.route(logits, "sqrtsoftplus", bias, vision_bias, image, 6, True, 1.5)
        w, e = route(dev(logits), dev(bias), dev(vision_bias), dev(image), 6, True, 1.5)
        assert torch.equal(e.cpu(), ref_e)
        assert _rel(w, ref_w) <= (EXACT if dtype == torch.float64 else 1e-6)
        gate, up = (torch.randn(4, 300, generator=g) * 6).to(dtype), (torch.randn(4, 300, generator=g) * 6).to(dtype)
        weights = torch.rand(4, 1, generator=g).to(logits.dtype)
        ref = expert_ops.swiglu(gate, up, 10.0, weights, dtype)
        assert _rel(swiglu(dev(gate), dev(up), 10.0, dev(weights), dtype), ref) <= max(bound, 2.0**-8)


def test_ring_write_stores_the_packed_rows_of_the_exact_path():
    from modeling_deepseek_v41.cache.packed_rows import PackedRows
    from modeling_deepseek_v41.kernels.numerics import fp8_act_qdq
    from modeling_deepseek_v41.kernels.triton import ring_write

    g = torch.Generator().manual_seed(4)
    values = fp8_act_qdq(torch.randn(2, 3, 64, generator=g).to(torch.bfloat16))
    positions = torch.tensor([[7, 8, 9], [-1, 30, 31]])
    exact = PackedRows("fp8_e8m0", 2, 64, 12, torch.device("cpu"))
    live = positions >= 0
    batch_ids = torch.arange(2).unsqueeze(1).expand_as(positions)
    exact.write(batch_ids[live], (positions % 12)[live], values[live])
    codes, scales = torch.zeros(2, 12, 64, dtype=torch.uint8), torch.zeros(2, 12, 2, dtype=torch.uint8)
    held = torch.full((2, 12), -1)
    codes, scales, held = codes.to(DEVICE), scales.to(DEVICE), held.to(DEVICE)
    ring_write(values.to(DEVICE), positions.to(DEVICE), codes, scales, held)
    decoded = PackedRows("fp8_e8m0", 2, 64, 12, torch.device("cpu"))
    decoded.codes, decoded.scales = codes.cpu(), scales.cpu()
    assert torch.equal(decoded.read(12, torch.float32), exact.read(12, torch.float32))
    expected = torch.full((2, 12), -1)
    expected[batch_ids[live], (positions % 12)[live]] = positions[live]
    assert torch.equal(held.cpu(), expected)


def test_a_long_chunk_leaves_the_ring_the_exact_path_leaves(monkeypatch):
    """A chunk longer than the ring goes through the one-launch write too (nothing read back to the host), its
    overwritten positions written as padding: the same slots, codes and positions as the exact path's."""
    from modeling_deepseek_v41.cache import ring as ring_module
    from modeling_deepseek_v41.kernels.numerics import fp8_act_qdq

    g = torch.Generator().manual_seed(5)
    values = fp8_act_qdq(torch.randn(2, 20, 64, generator=g).to(torch.bfloat16))
    positions = torch.stack([torch.arange(3, 23), torch.cat([torch.full((5,), -1), torch.arange(40, 55)])])
    kernels, launched = ring_module.triton_kernels(), []

    class Recording:  # the launch sees each slot at most once per row (its precondition: no two writes race)
        def ring_write(self, values, positions, *storage):
            launched.append(positions.cpu())
            return kernels.ring_write(values, positions, *storage)
    monkeypatch.setattr(ring_module, "triton_kernels", Recording)
    rings = []
    for fused in (False, True):
        monkeypatch.setattr(ring_module, "kernel_path", lambda x, fused=fused: fused)
        ring = ring_module.Ring(12, 64, 2, torch.device(DEVICE))
        ring.write(values.to(DEVICE), positions.to(DEVICE))
        rings.append(ring)
    exact, fused = rings
    for row in launched[0]:
        written = row[row >= 0]
        assert len(set((written % 12).tolist())) == len(written) == 12
    assert torch.equal(fused.positions, exact.positions)
    assert torch.equal(fused.rows.codes, exact.rows.codes) and torch.equal(fused.rows.scales, exact.rows.scales)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_compiled_attention_formulation_computes_the_blocked_softmax(dtype):
    """The accelerator's closed form of the blocked online softmax against the sequential loop (the reference)."""
    from modeling_deepseek_v41.kernels.sparse_attention import _fused_sparse_attention, sparse_attention

    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 3, 4, 32, generator=g) * 2).to(dtype)
    entries = torch.randn(2, 3, 150, 32, generator=g).to(dtype)
    valid = torch.rand(2, 3, 150, generator=g) < 0.8
    valid[0, 0] = False  # nothing to attend to: zeros
    valid[1, 2, :70] = False  # the first block empty, the second starting the running max
    sink = torch.randn(4, generator=g)
    with torch.no_grad():
        ref = sparse_attention(q, entries, valid, sink, 0.2)  # the CPU's exact loop
        out = _fused_sparse_attention(q, entries, valid, sink, 0.2)
    assert _rel(out, ref) <= (EXACT if dtype == torch.float64 else 4e-3)
    assert out[0, 0].abs().max() == 0


@pytest.mark.skipif(CUDA, reason="the float64 model runs the fused ops in the interpreter")
def test_static_decode_steps_with_the_fused_ops_equal_the_exact_steps(monkeypatch):
    """A float64 model's static-cache decode steps through every fused op (mHC, RMSNorm, window entry, ring store,
    stored attention, routing, SwiGLU; the interpreter runs them) give the exact path's logits to 1e-10."""
    import copy
    import sys

    from model_factory import random_model
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    model = random_model(dtype=torch.float64, seed=7)
    ids = torch.randint(3, model.config.text_config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config)
        model(ids[:, :27], cache=cache)
        cache.make_static(31)
        fused_cache = copy.deepcopy(cache)
        exact = [model(ids[:, t:t + 1], cache=cache).logits for t in range(27, 29)]
        for name in ("kernels.mhc", "kernels.sparse_attention", "kernels.expert_ops", "kernels.linear",
                     "cache.ring"):
            monkeypatch.setattr(sys.modules[f"modeling_deepseek_v41.{name}"], "kernel_path",
                                lambda x: not torch.is_grad_enabled() and x.numel() > 0)
        fused = [model(ids[:, t:t + 1], cache=fused_cache).logits for t in range(27, 29)]
    for got, ref in zip(fused, exact):
        assert _rel(got, ref) <= EXACT


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_chunk_attends_through_a_spanning_ring(dtype, launch):
    """A prefill chunk longer than its ring holds lists its windows from a spanning ring (the ring's earlier
    entries and the chunk's, `Ring.spanning`): the stored attention over it equals the exact attention over the
    entries listed from the chunk and the ring as before (`Ring.list_entries`); on a GPU at the released widths."""
    from modeling_deepseek_v41.cache.ring import Ring
    from modeling_deepseek_v41.kernels.rope import apply_rope_tail
    from modeling_deepseek_v41.kernels.sparse_attention import sparse_attention

    heads, dim, rope, window, slots, earlier, seq, pool_rows, topk = (
        (64, 512, 64, 128, 192, 300, 2000, 1200, 512) if CUDA else (3, 128, 16, 16, 24, 30, 40, 50, 12))
    g = torch.Generator().manual_seed(3)

    def window_entries(n):  # as the model writes them: FP8-QDQ'd
        return numerics.fp8_act_qdq(torch.randn(1, n, dim, generator=g, dtype=torch.float64)).to(dtype).to(DEVICE)
    positions = torch.arange(earlier, earlier + seq, device=DEVICE).unsqueeze(0)
    chunk_start = torch.tensor([earlier], device=DEVICE)
    pool_codes, pool_scales = fp4_quantize_rows(torch.randn(1, pool_rows, dim, generator=g), 16, "e4m3")
    pool = StoredPool(pool_codes.to(DEVICE), pool_scales.to(torch.float8_e4m3fn).view(torch.uint8).to(DEVICE))
    selected = torch.stack([torch.randperm(pool_rows, generator=g)[:topk].sort().values for _ in range(seq)])
    selected[:, -5:] = -1  # fewer rows than the selection's width
    selected = selected.unsqueeze(0).to(DEVICE)
    q = torch.randn(1, seq, heads, dim, generator=g).to(dtype).to(DEVICE)
    angles = positions.unsqueeze(-1).float().cpu() * torch.rand(rope // 2, generator=g)
    rotation = torch.polar(torch.ones_like(angles), angles).to(DEVICE)
    sink = torch.randn(heads, generator=g).to(DEVICE)
    with torch.no_grad():
        ring = Ring(slots, dim, 1, torch.device(DEVICE))
        ring.write(window_entries(earlier), torch.arange(earlier, device=DEVICE).unsqueeze(0))
        chunk_kv = window_entries(seq)
        listed, valid = ring.list_entries(chunk_kv.double(), positions, window, window, None, 0, chunk_start)
        pooled = numerics.fp4_dequantize_rows(pool.codes, pool.scales.view(torch.float8_e4m3fn), torch.float64)
        pooled = pooled[0, selected[0].clamp_min(0)].unsqueeze(0)
        entries, valid = torch.cat([listed, pooled], dim=2), torch.cat([valid, selected >= 0], dim=2)
        ref = sparse_attention(apply_rope_tail(q.double(), rotation, rope), entries, valid, sink.double(), 0.05)
        ref = apply_rope_tail(ref, rotation, rope, inverse=True)
        del entries, listed, pooled
        spanning = ring.spanning(chunk_kv, positions, chunk_start)
        out = stored_attention(q, rotation, rope, positions, None, window, spanning.stored(window), pool, selected,
                               sink, 0.05)
    # bf16 against the float64 math: its own roundings (queries, probabilities, output), 2.2e-3 measured on the CPU
    assert _rel(out, ref) <= (EXACT if dtype == torch.float64 else 5e-3)


@pytest.mark.slow  # 30 s in the interpreter; test_a_long_chunk_attends_through_a_spanning_ring covers the kernel
@pytest.mark.skipif(CUDA, reason="the float64 model runs the fused ops in the interpreter")
@pytest.mark.parametrize("mode", ["exact", "bounded_replay"])
def test_long_chunks_through_the_stored_attention_equal_the_exact_prefill(monkeypatch, mode):
    """Prefill chunks longer than a ring holds list their windows from a spanning ring (the ring's earlier entries
    and the chunk's) into the stored attention: a float64 model's logits equal the exact path's, in one prefill mode
    and the other (CED's replayed windows start at a floor)."""
    import sys

    from model_factory import random_model
    from modeling_deepseek_v41.cache import DeepseekV41Cache

    model = random_model(dtype=torch.float64, seed=7)
    text = model.config.text_config
    cut = text.sliding_window + 6  # two chunks longer than a window + 4 slot ring holds; the second reads the first
    ids = torch.randint(3, text.vocab_size, (1, 2 * cut), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache = DeepseekV41Cache(model.config, crop_horizon=4)
        exact = [model(ids[:, :cut], cache=cache, prefill_mode=mode).logits,
                 model(ids[:, cut:], cache=cache, prefill_mode=mode).logits]
        for name in ("kernels.sparse_attention", "cache.ring", "cache.cache_store"):
            monkeypatch.setattr(sys.modules[f"modeling_deepseek_v41.{name}"], "kernel_path",
                                lambda x: not torch.is_grad_enabled() and x.numel() > 0)
        cache = DeepseekV41Cache(model.config, crop_horizon=4)
        fused = [model(ids[:, :cut], cache=cache, prefill_mode=mode).logits,
                 model(ids[:, cut:], cache=cache, prefill_mode=mode).logits]
    assert not any(ring.holds_chunk(cut, text.sliding_window) for ring in cache.rings.values())
    for got, ref in zip(fused, exact):
        assert _rel(got, ref) <= EXACT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] + ([] if CUDA else [torch.float64]))
@pytest.mark.parametrize("block, scale_format", [(32, "e8m0"), (16, "e4m3")], ids=["index", "pool"])
def test_fp4_rows_equal_the_numerics_bit_for_bit(dtype, block, scale_format):
    """The one-launch FP4 row quantization (index queries' QDQ, index keys and compressed KV rows packed) gives
    numerics' bits: values (signed zeros too), packed codes and scales; over 40 binades, with exact ties of the
    e2m1 grid, zero and negative-zero groups."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 128, generator=g) * torch.logspace(-30, 10, 128)
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = -0.0
    x[1, 0, :16] = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 0])
    x = x.to(dtype)
    expected = numerics.fp4_qdq(x, block, scale_format)
    got = fp4_rows(x.to(DEVICE), block, scale_format, packed=False).cpu()
    assert got.dtype == dtype and torch.equal(torch.signbit(got), torch.signbit(expected))
    assert torch.equal(got, expected)
    codes, scales = fp4_rows(x.to(DEVICE), block, scale_format, packed=True)
    expected_codes, expected_scales = numerics.fp4_quantize_rows(x, block, scale_format)
    assert torch.equal(codes.cpu(), expected_codes) and torch.equal(scales.cpu(), expected_scales)
