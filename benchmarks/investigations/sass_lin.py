import sys; sys.path.insert(0, 'benchmarks/investigations'); sys.path.insert(0, '.')
import triton, triton.language as tl
from sass import compile_sm90, report, loop_report
from modeling_deepseek_v41.kernels.triton.linear import _linear_kernel
from probe_linear import _slice_kernel, _bw_kernel

sig = dict(x_ptr="*bf16", xs_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*u8", out_ptr="*bf16", part_ptr="*fp32",
           count_ptr="*i32", M="i32", N="i32", K="i32", k_chunk="i32", splits="i32", stride_xm="i32",
           stride_xsm="i32", stride_wn="i32", stride_sn="i32", stride_om="i32")
k = compile_sm90(_linear_kernel, sig, dict(BN=64, BM=32, BK=128, WFMT=1, FP8_DOT=False, X_DTYPE=tl.bfloat16,
                                           DOT_DTYPE=tl.bfloat16, IEEE=False), 4, 3)
report(k, "linear exact"); t = loop_report(k, "linear exact", 64 * 128)
open("/tmp/lin.sass", "w").write(t)
sig2 = dict(w_ptr="*u8", out_ptr="*i32", k_chunk="i32", stride_wn="i32")
k = compile_sm90(_bw_kernel, sig2, dict(BN=32, BK=256), 4, 3)
report(k, "bw"); t = loop_report(k, "bw", 32 * 256)
open("/tmp/bw.sass", "w").write(t)
sig3 = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", s_ptr="*u8", out_ptr="*bf16", part_ptr="*fp32",
           count_ptr="*i32", M="i32", N="i32", k_chunk="i32", splits="i32", stride_xm="i32",
           stride_xsm="i32", stride_wn="i32", stride_sn="i32", stride_om="i32")
k = compile_sm90(_slice_kernel, sig3, dict(BN=128, BM=16, MODE=0), 4, 4)
report(k, "w8a8 slice"); t = loop_report(k, "w8a8", 128 * 32)
open("/tmp/w8a8.sass", "w").write(t)
