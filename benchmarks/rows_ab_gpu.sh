#!/bin/bash
# One device call (carry [".whl"], from the repository root, about 550 s): the decode rows with the experts on the
# tensor cores (the default since the fifteenth session) beside the CUDA-core experts, the DSpark rows included and
# the default profiled, then the Gluon rows kernel for FP8 linears (benchmarks/investigations/fp8_rows) against the
# package's Triton one at the decode step's shapes and 1, 6 and 8 rows
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 170 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --profile 1 --profile-verify 2>&1 \
    | grep -v "Loading weights" > $OUT/rw_default.log
timeout 150 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --no-moe-mma 2>&1 \
    | grep -v "Loading weights" > $OUT/rw_cuda_cores.log
grep "^{" $OUT/rw_default.log $OUT/rw_cuda_cores.log | grep -v '"mode"' | cut -c1-300
timeout 200 python3 benchmarks/investigations/fp8_rows/check.py gpu > $OUT/fp8_rows.log 2>&1
cat $OUT/fp8_rows.log | tail -30
