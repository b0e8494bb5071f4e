import triton
import triton.language as tl
from modeling_deepseek_v41.kernels.triton.common import e8m0_value

# 4 packed e2m1 bytes -> 8 fp16 (x 2^-6): nibbles re-encoded as e4m3 bytes by integer ops, then the hardware's
# e4m3x2 -> f16x2 conversion
_FP4_ASM = tl.constexpr("""
{
.reg .b32 e, o, t;
.reg .b16 e0, e1, o0, o1;
shl.b32 e, $4, 4;
shl.b32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
lop3.b32 e, e, 0x80808080, t, 0xEA;
shr.u32 t, $4, 2;
and.b32 t, t, 0x1C1C1C1C;
lop3.b32 o, $4, 0x80808080, t, 0xEA;
mov.b32 {e0, e1}, e;
mov.b32 {o0, o1}, o;
cvt.rn.f16x2.e4m3x2 $0, e0;
cvt.rn.f16x2.e4m3x2 $1, e1;
cvt.rn.f16x2.e4m3x2 $2, o0;
cvt.rn.f16x2.e4m3x2 $3, o1;
}
""")


@triton.jit
def fp4_halves(byte, IEEE: tl.constexpr):
    if IEEE:
        b = byte.to(tl.int32)
        even = (((b & 8) << 4) | ((b & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        odd = ((b & 0x80) | ((b >> 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        even, odd = tl.inline_asm_elementwise(_FP4_ASM, "=r,=r,=r,=r,r", [byte], (tl.float16, tl.float16), True, 4)
    return even, odd


@triton.jit
def fp4_dot_v2(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, row_mask, k_start, k_stop, N, K,
               stride_wn, stride_sn, stride_xm, stride_xsm, BK: tl.constexpr, IEEE: tl.constexpr):
    half = tl.arange(0, 16)
    w_rows = w_ptr + offs_n[:, None] * stride_wn + half[None, :]
    x_cols = x_ptr + rows[None, :] * stride_xm + half[:, None]
    s_rows = s_ptr + offs_n * stride_sn
    for k in range(k_start, k_stop, BK):
        for j in tl.static_range(BK // 32):
            k0 = k + j * 32
            byte = tl.load(w_rows + k0 // 2)
            even, odd = fp4_halves(byte, IEEE)
            x_even = tl.load(x_cols + k0)
            x_odd = tl.load(x_cols + k0 + 16)
            ws = 64.0 * e8m0_value(s_rows + k0 // 32, offs_n >= 0)
            xs = tl.load(xs_ptr + rows * stride_xsm + k0 // 32)
            if IEEE:
                part = tl.dot(even, x_even.to(tl.float32), input_precision="ieee")
                part = tl.dot(odd, x_odd.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(even, x_even)
                part = tl.dot(odd, x_odd, part)
            acc += part * (ws[:, None] * xs[None, :])
    return acc


@triton.jit
def probe_v2(w_ptr, s_ptr, x_ptr, xs_ptr, out_ptr, K, stride_wn, stride_sn, stride_xm, stride_xsm,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    acc = fp4_dot_v2(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, rows < 16, 0, K, 4096, K,
                     stride_wn, stride_sn, stride_xm, stride_xsm, BK, IEEE)
    tl.store(out_ptr + offs_n[:, None] * BM + rows[None, :], acc)
