import sys; sys.path.insert(0, 'benchmarks/investigations'); sys.path.insert(0, '.')
from sass import compile_sm90, report, loop_report
from fp4v2 import probe_v2
sig = {"w_ptr": "*i8", "s_ptr": "*u8", "x_ptr": "*fp16", "xs_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32",
       "stride_wn": "i32", "stride_sn": "i32", "stride_xm": "i32", "stride_xsm": "i32"}
for bn, bm, bk, w in ((64, 16, 128, 4), (64, 8, 128, 4), (128, 8, 128, 4), (128, 16, 128, 4), (64, 8, 64, 4)):
    k = compile_sm90(probe_v2, sig, {"BN": bn, "BM": bm, "BK": bk, "IEEE": False}, num_warps=w, num_stages=3)
    report(k, f"v2 BN{bn} BM{bm} BK{bk}")
    t = loop_report(k, f"v2 BN{bn} BM{bm} BK{bk}", bn * bk // 2 * 4 / w)
    open(f"/tmp/v2_{bn}_{bm}.sass", "w").write(t)
