"""The mHC steps between sublayers in two launches: write a sublayer's output into the streams (expand), compute
the next sublayer's mixes (fp32 projection, RMS statistic, Sinkhorn) and its input (collapse, RMSNorm).

The math is `kernels.mhc`'s exact path, in its order: the expanded streams rounded to the streams' dtype before
anything reads them, the collapse rounded to it before the norm, the norm's weight applied after the normalisation.
The projection's 4*D inputs are split over programs (BD columns of each stream per program; up to DECODE_ROWS rows
a split from D alone, so a decode row's result never depends on the row count); a second launch sums the partials,
normalises the collapsed rows and runs the Sinkhorn iterations. The fp32 projection of the bf16 streams runs on the
tensor cores with every product exact (see _split_dot); only the fp32 summation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, reduce_max, reduce_sum
from .launch import launch_options, wait_for_inputs

BLOCK_ROWS, DECODE_WARPS = 16, 4  # rows per program (the projection's dot needs 16)
DECODE_ROWS = 256
BLOCK_D = 32  # columns of each stream per program: 160 programs per row block at D = 5120 (H200, one row: 17 us vs 29 at 128)
# past DECODE_ROWS: 64 rows x 64 columns per program (H200, 16K rows, split dot: 3.27 ms; 64 x 32: 3.67)
PREFILL_BLOCK_ROWS, PREFILL_BLOCK_D, PREFILL_WARPS = 64, 64, 4
# the fp32 projection as three bf16 tensor-core dots with exact products (bf16 streams), not an fp32 dot on the CUDA
# cores (H200, expand + read: 32.5 -> 18.3 us at one row, 8.4 -> 3.3 ms at 16K rows)
SPLIT_DOT = True
MIX_COLUMNS = 32  # the (2 + hc) * hc = 24 mixes, padded; laid out [comb (16) | pre (4) | post (4) | unused]
NORM_CHUNK = 1024  # columns normalised per program of the second launch


@triton.jit
def _mix_rows(j, HC: tl.constexpr):
    """The projection row behind padded mix column j: comb first (rows 2*hc..), then pre (0..hc), post (hc..2hc)."""
    n_comb = HC * HC
    return tl.where(j < n_comb, j + 2 * HC, j - n_comb)


@triton.jit
def _sinkhorn(mixes, scale_ptr, base_ptr, iters, eps, BR: tl.constexpr, HC: tl.constexpr, ACC: tl.constexpr):
    """(pre [BR,HC], post [BR,HC], comb [BR,HC,HC]) from the normalised mixes [BR, MIX_COLUMNS]."""
    comb_part, rest = tl.split(tl.permute(tl.reshape(mixes, [BR, 2, HC * HC]), [0, 2, 1]))
    gates, _ = tl.split(tl.permute(tl.reshape(rest, [BR, 2, 2 * HC]), [0, 2, 1]))
    pre, post = tl.split(tl.permute(tl.reshape(gates, [BR, 2, HC]), [0, 2, 1]))
    lane = tl.arange(0, HC)
    s0 = tl.load(scale_ptr).to(ACC)
    s1 = tl.load(scale_ptr + 1).to(ACC)
    s2 = tl.load(scale_ptr + 2).to(ACC)
    pre = pre * s0 + tl.load(base_ptr + lane).to(ACC)[None, :]
    pre = 1.0 / (1.0 + tl.exp(-pre)) + eps
    post = post * s1 + tl.load(base_ptr + HC + lane).to(ACC)[None, :]
    post = 2.0 * (1.0 / (1.0 + tl.exp(-post)))
    cell = lane[:, None] * HC + lane[None, :]
    comb = tl.reshape(comb_part, [BR, HC, HC]) * s2 + tl.load(base_ptr + 2 * HC + cell).to(ACC)[None, :, :]
    comb = tl.exp(comb - reduce_max(comb, 2)[:, :, None])
    comb = comb / reduce_sum(comb, 2)[:, :, None] + eps
    comb = comb / (reduce_sum(comb, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (reduce_sum(comb, 2)[:, :, None] + eps)
        comb = comb / (reduce_sum(comb, 1)[:, None, :] + eps)
    return pre, post, comb


@triton.jit
def _split_dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b for a [M, K] whose values are exact in bf16 (the streams) and an fp32 b [K, N], every product
    exact: b == b1 + b2 + b3 exactly for three bf16 parts (each takes the next 8 of fp32's 24 significant bits;
    for 2^-100 < |b| < 2^127, where the last part stays a normal bf16: the mix weights are far inside), a bf16 x
    bf16 product is exact in fp32, so three tensor-core dots with fp32 accumulation replace one fp32 dot on the
    CUDA cores (IEEE: the parts' dots in IEEE fp32 instead, as the interpreter needs)."""
    a16 = a.to(tl.bfloat16)
    b1 = b.to(tl.bfloat16)
    rest = b - b1.to(tl.float32)
    b2 = rest.to(tl.bfloat16)
    b3 = (rest - b2.to(tl.float32)).to(tl.bfloat16)
    if IEEE:
        a32 = a16.to(tl.float32)
        acc += tl.dot(a32, b3.to(tl.float32), input_precision="ieee")
        acc += tl.dot(a32, b2.to(tl.float32), input_precision="ieee")
        acc += tl.dot(a32, b1.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a16, b3, acc)
        acc = tl.dot(a16, b2, acc)
        acc = tl.dot(a16, b1, acc)
    return acc


@triton.jit
def _hc_partials_kernel(streams_ptr, out_ptr, post_in_ptr, comb_in_ptr, new_ptr, weights_ptr, fn_ptr, part_ptr,
                        x_ptr, R, D, BR: tl.constexpr, BD: tl.constexpr, HC: tl.constexpr, MIXP: tl.constexpr,
                        EXPAND: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """One row block x one column split. streams [R, HC, D]; EXPAND: out [R, D], post_in [R, HC],
    comb_in [R, HC, HC] give the streams actually read (new = post_in * out + sum_i comb_in[i] * streams[i], stored
    to new_ptr). weights [R, HC]: this sublayer's read weights (the previous mixes' pre). Stores the split's
    partial projection, RMS statistic and collapse statistic, and x [R, D] = the collapse (normalised later)."""
    wait_for_inputs()
    pid_r = tl.program_id(0).to(tl.int64)  # a row's streams start past 2^31 elements beyond 104,857 rows
    pid_s = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    row_ok = rows < R
    d = pid_s * BD + tl.arange(0, BD)
    d_ok = d < D
    mask = row_ok[:, None] & d_ok[None, :]
    j = tl.arange(0, MIXP)
    fn_rows = _mix_rows(j, HC)
    fn_ok = (j < HC * (HC + 2))[None, :] & d_ok[:, None]
    lane = tl.arange(0, HC)
    read = tl.load(weights_ptr + rows[:, None] * HC + lane[None, :], mask=row_ok[:, None], other=0.0).to(ACC)
    if EXPAND:
        sub = tl.load(out_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(ACC)
        post_in = tl.load(post_in_ptr + rows[:, None] * HC + lane[None, :], mask=row_ok[:, None], other=0.0).to(ACC)
    mix = tl.full([BR, MIXP], 0.0, ACC)
    square = tl.full([BR], 0.0, ACC)
    collapsed = tl.full([BR, BD], 0.0, ACC)
    for c in tl.static_range(HC):
        if EXPAND:
            mixed = tl.full([BR, BD], 0.0, ACC)
            for i in tl.static_range(HC):
                w = tl.load(comb_in_ptr + rows * (HC * HC) + i * HC + c, mask=row_ok, other=0.0).to(ACC)
                old = tl.load(streams_ptr + (rows[:, None] * HC + i) * D + d[None, :], mask=mask, other=0.0)
                mixed += w[:, None] * old.to(ACC)
            p = reduce_sum(tl.where(lane[None, :] == c, post_in, 0.0), 1)
            stream = cast(p[:, None] * sub + mixed, new_ptr.dtype.element_ty)
            tl.store(new_ptr + (rows[:, None] * HC + c) * D + d[None, :], stream, mask=mask)
            stream = stream.to(ACC)
        else:
            stream = tl.load(streams_ptr + (rows[:, None] * HC + c) * D + d[None, :], mask=mask, other=0.0).to(ACC)
        fn = tl.load(fn_ptr + fn_rows[None, :] * (HC * D) + c * D + d[:, None], mask=fn_ok, other=0.0).to(ACC)
        if SPLIT:
            mix = _split_dot(stream, fn, mix, IEEE)
        elif IEEE:
            mix += tl.dot(stream, fn, input_precision="ieee")
        else:
            mix += tl.dot(stream, fn)
        square += reduce_sum(stream * stream, 1)
        collapsed += reduce_sum(tl.where(lane[None, :] == c, read, 0.0), 1)[:, None] * stream
    y = cast(collapsed, x_ptr.dtype.element_ty)
    tl.store(x_ptr + rows[:, None] * D + d[None, :], y, mask=mask)
    y = tl.where(mask, y.to(ACC), 0.0)
    stride = MIXP + 2
    part = part_ptr + (pid_s * R + rows) * stride
    tl.store(part[:, None] + j[None, :], mix, mask=row_ok[:, None])
    tl.store(part + MIXP, square, mask=row_ok)
    tl.store(part + MIXP + 1, reduce_sum(y * y, 1), mask=row_ok)


@triton.jit
def _hc_finish_kernel(part_ptr, scale_ptr, base_ptr, norm_ptr, pre_ptr, post_ptr, comb_ptr, x_ptr, R, D, splits,
                      iters, hc_eps, mix_eps, norm_eps, SP: tl.constexpr, BD: tl.constexpr, HC: tl.constexpr,
                      MIXP: tl.constexpr, ACC: tl.constexpr):
    """One row x one column chunk: the split partials summed (one fixed-shape reduction, so a row's result never
    depends on the row count), the collapse normalised; chunk 0 also runs the Sinkhorn and writes the mixes."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    stride = MIXP + 2
    s = tl.arange(0, SP)
    s_ok = s < splits
    part = part_ptr + (s * R + r) * stride
    y_square = reduce_sum(tl.load(part + MIXP + 1, mask=s_ok, other=0.0), 0)
    d = pid_d * BD + tl.arange(0, BD)
    ok = d < D
    y = tl.load(x_ptr + r * D + d, mask=ok, other=0.0).to(ACC)
    w = tl.load(norm_ptr + d, mask=ok, other=0.0).to(ACC)
    inv_rms = tl.math.rsqrt(y_square / D + norm_eps)
    tl.store(x_ptr + r * D + d, cast(w * (y * inv_rms), x_ptr.dtype.element_ty), mask=ok)
    if pid_d == 0:
        j = tl.arange(0, MIXP)
        mix = reduce_sum(tl.load(part[:, None] + j[None, :], mask=s_ok[:, None], other=0.0), 0)[None, :]
        square = reduce_sum(tl.load(part + MIXP, mask=s_ok, other=0.0), 0)
        mix = mix * tl.math.rsqrt(square / (HC * D) + mix_eps)
        pre, post, comb = _sinkhorn(mix, scale_ptr, base_ptr, iters, hc_eps, 1, HC, ACC)
        lane = tl.arange(0, HC)
        tl.store(pre_ptr + r * HC + lane[None, :], pre)
        tl.store(post_ptr + r * HC + lane[None, :], post)
        tl.store(comb_ptr + r * (HC * HC) + lane[None, :, None] * HC + lane[None, None, :], comb)


_ACC = {torch.float64: tl.float64}


def _rows_or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """t as contiguous rows [R, -1], or a stand-in pointer for an operand the launch does not read."""
    return stand_in if t is None else t.reshape(stand_in.shape[0], -1).contiguous()


def hc_step(streams: torch.Tensor, read_weights: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
            base: torch.Tensor, norm_weight: torch.Tensor, sinkhorn_iters: int, hc_eps: float, mix_eps: float,
            norm_eps: float, output: torch.Tensor | None = None, post: torch.Tensor | None = None,
            comb: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(streams read, pre, post, comb, x) for streams [..., hc, D] (see the kernel). With output/post/comb the
    sublayer's output is first written into the streams (the returned streams are the new ones)."""
    lead, (hc, d) = streams.shape[:-2], streams.shape[-2:]
    rows = streams.reshape(-1, hc, d).contiguous()
    r = rows.shape[0]
    acc = _ACC.get(streams.dtype, tl.float32)
    expand = output is not None
    new = torch.empty_like(rows) if expand else rows
    out_dtype = torch.float32 if acc == tl.float32 else torch.float64
    pre_out = torch.empty(r, hc, dtype=out_dtype, device=streams.device)
    post_out = torch.empty(r, hc, dtype=out_dtype, device=streams.device)
    comb_out = torch.empty(r, hc, hc, dtype=out_dtype, device=streams.device)
    x = torch.empty(r, d, dtype=streams.dtype, device=streams.device)
    block_rows, block_d, warps = (BLOCK_ROWS, BLOCK_D, DECODE_WARPS) if r <= DECODE_ROWS else \
        (PREFILL_BLOCK_ROWS, PREFILL_BLOCK_D, PREFILL_WARPS)
    splits = triton.cdiv(d, block_d)
    part = torch.empty(splits, r, MIX_COLUMNS + 2, dtype=out_dtype, device=streams.device)
    cpu = streams.device.type == "cpu"
    split = SPLIT_DOT and acc == tl.float32 and streams.dtype == torch.bfloat16
    ieee = cpu or (acc == tl.float32 and not split)  # the interpreter's dots in IEEE fp32
    _hc_partials_kernel[(triton.cdiv(r, block_rows), splits)](
        rows, _rows_or(output, rows), _rows_or(post, rows), _rows_or(comb, rows), new,
        read_weights.reshape(r, hc).contiguous(), fn.contiguous(), part, x, r, d, BR=block_rows, BD=block_d, HC=hc,
        MIXP=MIX_COLUMNS, EXPAND=expand, ACC=acc, IEEE=ieee, SPLIT=split, num_warps=warps, **launch_options())
    _hc_finish_kernel[(r, triton.cdiv(d, NORM_CHUNK))](
        part, scale, base, norm_weight, pre_out, post_out, comb_out, x, r, d, splits, sinkhorn_iters, hc_eps, mix_eps,
        norm_eps, SP=triton.next_power_of_2(splits), BD=NORM_CHUNK, HC=hc, MIXP=MIX_COLUMNS, ACC=acc, num_warps=4,
        **launch_options())
    return (new.view(*lead, hc, d), pre_out.view(*lead, hc), post_out.view(*lead, hc),
            comb_out.view(*lead, hc, hc), x.view(*lead, d))


@triton.jit
def _hc_expand_kernel(streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, R, D, BD: tl.constexpr, HC: tl.constexpr,
                      ACC: tl.constexpr):
    """new[r, c] = post[r, c] * out[r] + sum_i comb[r, i, c] * streams[r, i], rounded to the streams' dtype."""
    wait_for_inputs()
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = d < D
    sub = tl.load(out_ptr + r * D + d, mask=ok, other=0.0).to(ACC)
    for c in tl.static_range(HC):
        mixed = tl.full([BD], 0.0, ACC)
        for i in tl.static_range(HC):
            w = tl.load(comb_ptr + r * (HC * HC) + i * HC + c).to(ACC)
            mixed += w * tl.load(streams_ptr + (r * HC + i) * D + d, mask=ok, other=0.0).to(ACC)
        p = tl.load(post_ptr + r * HC + c).to(ACC)
        tl.store(new_ptr + (r * HC + c) * D + d, cast(p * sub + mixed, new_ptr.dtype.element_ty), mask=ok)


def hc_expand(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """kernels.mhc.hc_expand on the GPU: streams [..., hc, D], output [..., D] -> the new streams."""
    lead, (hc, d) = streams.shape[:-2], streams.shape[-2:]
    rows = streams.reshape(-1, hc, d).contiguous()
    r = rows.shape[0]
    new = torch.empty_like(rows)
    block = 1024
    _hc_expand_kernel[(r, triton.cdiv(d, block))](
        rows, output.reshape(r, d).contiguous(), post.reshape(r, hc).contiguous(),
        comb.reshape(r, hc * hc).contiguous(), new, r, d, BD=block, HC=hc, ACC=_ACC.get(streams.dtype, tl.float32),
        num_warps=4, **launch_options())
    return new.view(*lead, hc, d)
