#!/bin/bash
# One device call (carry [".whl"], from the repository root, about 550 s): whether the decode kernels wait on load
# latency. The expert formulations over tilings with and without each next slice's loads issued ahead
# (kernel_tuning.py --only moe), then whole decode steps at the released widths without and with --prefetch, each
# with the rows experts and with the tensor-core experts (--moe-mma), batch 1 and 32, the prefetch rows profiled.
# Run at abca36d (results.md, fifteenth session); since then the tensor-core experts prefetch by default
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/moe
timeout 170 python3 benchmarks/kernel_tuning.py --only moe --out $OUT/moe > $OUT/tune_moe.log 2>&1
grep -A30 "grouped_moe fp4" $OUT/tune_moe.log
for flags in "--no-moe-mma" "--no-moe-mma --prefetch --profile 1" "--moe-mma" "--moe-mma --prefetch --profile 1"; do
    name=rw$(echo "$flags" | tr -d ' -' | cut -c1-30)
    timeout 95 python3 benchmarks/realwidth.py --no-eager --no-dspark --batches 1 32 --steps 10 $flags 2>&1 \
        | grep -v "Loading weights" > $OUT/$name.log
    echo "== $flags"; grep "^{" $OUT/$name.log | grep -v '"mode"' | cut -c1-400
done
