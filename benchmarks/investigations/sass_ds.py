import sys; sys.path.insert(0, 'benchmarks/investigations'); sys.path.insert(0, '.')
from sass import compile_sm90, report, loop_report
from ds import probe_ds, probe_ds8
sig = {"w_ptr": "*u8", "s_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*fp32", "K": "i32",
       "stride_wn": "i32", "stride_sn": "i32", "stride_xm": "i32"}
for bn, bm, bk, w, fast in ((64, 16, 128, 4, True), (64, 16, 128, 4, False), (128, 16, 128, 4, True), (128, 8, 256, 4, True), (64, 8, 256, 4, True)):
    try:
        k = compile_sm90(probe_ds, sig, {"BN": bn, "BM": bm, "BK": bk, "FAST": fast}, num_warps=w, num_stages=3)
        report(k, f"ds fp4 BN{bn} BM{bm} BK{bk} fast{fast}")
        t = loop_report(k, f"ds fp4 BN{bn} BM{bm} BK{bk}", bn * bk // 2 * 4 / w)
        open(f"/tmp/ds_{bn}_{bm}_{bk}.sass", "w").write(t)
    except Exception as e:
        print("fail", bn, bm, bk, type(e).__name__, str(e)[:400])
sig8 = dict(sig, w_ptr="*fp8e4nv")
for bn, bm, bk, w in ((64, 16, 128, 4), (128, 16, 128, 4), (64, 32, 128, 4)):
    try:
        k = compile_sm90(probe_ds8, sig8, {"BN": bn, "BM": bm, "BK": bk, "FAST": True}, num_warps=w, num_stages=3)
        report(k, f"ds fp8 BN{bn} BM{bm} BK{bk}")
        t = loop_report(k, f"ds fp8 BN{bn} BM{bm} BK{bk}", bn * bk * 4 / w)
    except Exception as e:
        print("fail8", bn, bm, bk, type(e).__name__, str(e)[:400])
