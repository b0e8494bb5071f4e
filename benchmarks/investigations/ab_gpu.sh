#!/bin/bash
# One device call (carry [".whl"], run from the repository root, about 500 s): the tensor-core decode's GPU tests,
# the expert kernel's two weight orders, then whole decode steps and the DSpark rows at the released widths
# without and with the tensor cores (kernels.triton.use_mma_moe / use_mma_linears), the latter profiled
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q tests/kernels/test_mma_decode.py tests/gpu/test_tensor_core_decode.py -rs -x \
    > $OUT/mma_tests.log 2>&1
timeout 80 python3 benchmarks/investigations/fp4_mma/check.py gpu > $OUT/fp4_orders.log 2>&1
timeout 150 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill 2>&1 | grep -v "Loading weights" > $OUT/rw_base.log
timeout 220 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --moe-mma --linear-mma \
    --profile 32 --profile-verify 2>&1 | grep -v "Loading weights" > $OUT/rw_mma.log
tail -5 $OUT/mma_tests.log; tail -12 $OUT/fp4_orders.log; grep "^{" $OUT/rw_base.log $OUT/rw_mma.log
