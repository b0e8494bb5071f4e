#!/bin/bash
# The issue's decode rows with the experts' switch on (carry [".whl"], about 500 s): batch 1 and 32 without and with
# PDL and the DSpark rows at 4K, batch 1 at 64K, then the bf16 weight mode without and with the dense tensor-core
# linears (bf16 weights: the linears' switch untimed there)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --pdl both \
    --moe-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_mma_rows.log
timeout 100 python3 benchmarks/realwidth.py --no-eager --no-dspark --batches 1 --steps 10 --prefill --context 65536 \
    --moe-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_mma_64k.log
timeout 180 python3 benchmarks/realwidth.py --mode bf16 --no-eager --no-dspark --batches 1 --steps 10 --prefill \
    2>&1 | grep -v "Loading weights" > $OUT/rw_bf16.log
DEEPSEEK_V41_MMA_LINEARS=1 timeout 180 python3 benchmarks/realwidth.py --mode bf16 --no-eager --no-dspark \
    --batches 1 --steps 10 --prefill 2>&1 | grep -v "Loading weights" > $OUT/rw_bf16_mma.log
grep "^{" $OUT/rw_mma_rows.log $OUT/rw_mma_64k.log $OUT/rw_bf16.log $OUT/rw_bf16_mma.log
