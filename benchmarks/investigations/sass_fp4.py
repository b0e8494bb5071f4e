import sys; sys.path.insert(0, 'benchmarks/investigations'); sys.path.insert(0, '.')
import triton, triton.language as tl
from sass import compile_sm90, report, loop_report
from modeling_deepseek_v41.kernels.triton.common import fp4_f16_dot_k_range, dot_k_range


@triton.jit
def probe_f16(w_ptr, s_ptr, x_ptr, xs_ptr, out_ptr, K, stride_wn, stride_sn, stride_xm, stride_xsm,
              BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    acc = tl.full([BN, BM], 0.0, tl.float32)
    acc = fp4_f16_dot_k_range(acc, w_ptr, s_ptr, x_ptr, xs_ptr, offs_n, rows, rows < 16, 0, K, 4096, K,
                              stride_wn, stride_sn, stride_xm, stride_xsm, BK, False)
    tl.store(out_ptr + offs_n[:, None] * BM + rows[None, :], acc)


sig = {"w_ptr": "*i8", "s_ptr": "*u8", "x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32",
       "stride_wn": "i32", "stride_sn": "i32", "stride_xm": "i32", "stride_xsm": "i32"}
for bn, bk in ((64, 128), (128, 128)):
    k = compile_sm90(probe_f16, sig, {"BN": bn, "BM": 16, "BK": bk}, num_warps=4, num_stages=3)
    report(k, f"f16 slices BN{bn} BK{bk}")
    loop_report(k, f"f16 slices BN{bn} BK{bk}", bn * bk // 2)
