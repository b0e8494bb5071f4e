#!/bin/bash
# One device call (carry [".whl"], run from the repository root, about 550 s): the whole-model tests of the
# tensor-core decode, then whole decode steps and the DSpark rows at the released widths with the experts on the CUDA
# cores and on the tensor cores (kernels.triton.use_mma_moe: the default since the fifteenth session's H100 runs,
# see benchmarks/results.md), the latter profiled
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q tests/gpu/test_tensor_core_decode.py tests/kernels/test_mma_decode.py -rfs \
    -p no:cacheprovider > $OUT/mma_tests.log 2>&1
timeout 150 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --no-moe-mma 2>&1 \
    | grep -v "Loading weights" > $OUT/rw_base.log
timeout 180 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --moe-mma \
    --profile 1 32 --profile-verify 2>&1 | grep -v "Loading weights" > $OUT/rw_mma.log
tail -8 $OUT/mma_tests.log; grep "^{" $OUT/rw_base.log $OUT/rw_mma.log
