#!/bin/bash
# One device call (carry [".whl"], run from the repository root, about 550 s): the tensor-core decode's GPU tests,
# one 384-expert MoE layer in every formulation (its "fp4 mma" column), then whole decode steps and the DSpark rows
# at the released widths without and with the tensor cores (kernels.triton.use_mma_moe / use_mma_linears), the
# latter profiled
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q tests/kernels/test_mma_decode.py tests/gpu/test_tensor_core_decode.py -rs -x \
    > $OUT/mma_tests.log 2>&1
timeout 90 python3 benchmarks/triton_kernels.py --only moe --out $OUT/kernels > $OUT/moe_layer.log 2>&1
timeout 130 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill 2>&1 \
    | grep -v "Loading weights" > $OUT/rw_base.log
timeout 200 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --moe-mma --linear-mma \
    --profile 32 --profile-verify 2>&1 | grep -v "Loading weights" > $OUT/rw_mma.log
tail -5 $OUT/mma_tests.log; tail -8 $OUT/moe_layer.log; grep "^{" $OUT/rw_base.log $OUT/rw_mma.log
