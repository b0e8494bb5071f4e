#!/bin/bash
# One device call (carry [".whl"], from the repository root, about 150 s): Nsight Compute on the one-row decode
# kernels at the released shapes (the FP8 linears' rows kernel, the routed experts' rows kernels and their
# tensor-core kernel), to see whether they wait on memory (bytes in flight) or on issue: on the H100 both expert
# formulations read a batch-1 step's experts at about 46% of the bandwidth
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
KERNELS='regex:_linear_rows_kernel|_moe_rows_up_kernel|_moe_rows_down_kernel|_fp4_mma_kernel'
DEEPSEEK_V41_MMA_MOE=0 timeout 200 ncu --clock-control none --set full --kernel-name "$KERNELS" -o $OUT/rows \
    python3 benchmarks/ncu_probe.py wq_a wq_b wo_b shared_w1 moe > $OUT/ncu_rows.log 2>&1
DEEPSEEK_V41_MMA_MOE=1 timeout 150 ncu --clock-control none --set full --kernel-name "$KERNELS" -o $OUT/mma \
    python3 benchmarks/ncu_probe.py moe > $OUT/ncu_mma.log 2>&1
for report in rows mma; do
    ncu --import $OUT/$report.ncu-rep --page details > $OUT/$report.txt 2>&1
    grep -E "^  [_a-z]|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Eligible Warps|No Eligible" \
        $OUT/$report.txt | head -80
done
