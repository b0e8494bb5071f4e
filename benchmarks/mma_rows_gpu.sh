#!/bin/bash
# The decode rows with the tensor-core decode on (carry [".whl"], about 450 s): batch 1 and 32 without and
# with PDL and the DSpark rows at 4K, batch 1 at 64K, then the bf16 weight mode
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/realwidth.py --no-eager --batches 1 32 --steps 10 --prefill --pdl both \
    --moe-mma --linear-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_mma_rows.log
timeout 120 python3 benchmarks/realwidth.py --no-eager --no-dspark --batches 1 --steps 10 --prefill --context 65536 \
    --moe-mma --linear-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_mma_64k.log
timeout 200 python3 benchmarks/realwidth.py --mode bf16 --no-eager --no-dspark --batches 1 --steps 10 --prefill \
    --linear-mma 2>&1 | grep -v "Loading weights" > $OUT/rw_bf16_mma.log
grep "^{" $OUT/rw_mma_rows.log $OUT/rw_mma_64k.log $OUT/rw_bf16_mma.log
