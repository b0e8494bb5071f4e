import triton
import triton.language as tl


@triton.jit
def probe_ds(w_ptr, s_ptr, x_ptr, out_ptr, K, stride_wn, stride_sn, stride_xm,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr):
    """lhs: packed e2m1 weights [BN, BK/2] with e8m0 scales [BN, BK/32]; rhs: bf16 x^T [BK, BM]."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    kb = tl.arange(0, BK // 2)
    kx = tl.arange(0, BK)
    ks = tl.arange(0, BK // 32)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    for k in range(0, K, BK):
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k // 2 + kb)[None, :])
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (k // 32 + ks)[None, :])
        x = tl.load(x_ptr + rows[None, :] * stride_xm + (k + kx)[:, None])
        acc = tl.dot_scaled(w, s, "e2m1", x, None, "bf16", acc, fast_math=FAST)
    tl.store(out_ptr + offs_n[:, None] * BM + rows[None, :], acc)


@triton.jit
def probe_ds8(w_ptr, s_ptr, x_ptr, out_ptr, K, stride_wn, stride_sn, stride_xm,
              BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr):
    """lhs: e4m3 weights [BN, BK] with 32x32 tile scales (row n // 32); rhs: bf16 x^T [BK, BM]."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    kw = tl.arange(0, BK)
    ks = tl.arange(0, BK // 32)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    for k in range(0, K, BK):
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k + kw)[None, :])
        s = tl.load(s_ptr + (offs_n // 32)[:, None] * stride_sn + (k // 32 + ks)[None, :])
        x = tl.load(x_ptr + rows[None, :] * stride_xm + (k + kw)[:, None])
        acc = tl.dot_scaled(w, s, "e4m3", x, None, "bf16", acc, fast_math=FAST)
    tl.store(out_ptr + offs_n[:, None] * BM + rows[None, :], acc)
