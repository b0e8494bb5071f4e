import sys; sys.path.insert(0, 'benchmarks/investigations'); sys.path.insert(0, '.')
import triton.language as tl
from sass import compile_sm90, report, loop_report
from modeling_deepseek_v41.kernels.triton.fp32_rows import _fp32_rows_kernel
sig = dict(x_ptr="*fp32", w_ptr="*fp32", out_ptr="*fp32", part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32",
           K="i32", k_chunk="i32", splits="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
for bn, bk, bm, w, st in ((16, 64, 8, 4, 3), (32, 64, 4, 4, 3), (16, 128, 4, 4, 3), (32, 128, 8, 8, 3), (64, 64, 4, 4, 3)):
    k = compile_sm90(_fp32_rows_kernel, sig, dict(BN=bn, BK=bk, BM=bm, ACC=tl.float32), w, st)
    report(k, f"rows BN{bn} BK{bk} BM{bm} w{w}"); loop_report(k, "rows", bn * bk * 4 * 4 / w)
