#!/bin/bash
# One device call (carry [".whl"], run from the repository root, about 560 s): the package's tensor-core MoE tests
# on the GPU, both tensor-core candidates' checks in both weight orders, then whole decode steps and the DSpark
# rows at the released widths without and with them
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -x tests/kernels/test_moe_mma.py > $OUT/moe_mma_tests.log 2>&1
timeout 100 python3 benchmarks/investigations/fp4_mma/check.py gpu > $OUT/fp4_gpu.log 2>&1
timeout 80 python3 benchmarks/investigations/fp8_mma/check.py gpu > $OUT/fp8_gpu.log 2>&1
timeout 150 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 2>&1 | grep -v "Loading weights" > $OUT/rw_base.log
timeout 170 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --moe-mma --linear-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_mma.log
tail -3 $OUT/moe_mma_tests.log; tail -12 $OUT/fp4_gpu.log $OUT/fp8_gpu.log; grep "^{" $OUT/rw_base.log $OUT/rw_mma.log
