#!/bin/bash
# The device call after mma_ab_gpu.sh (carry [".whl"], about 560 s): the whole GPU suite with the experts' switch on
# (what turning it on by default would run), PDL included
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DEEPSEEK_V41_MMA_MOE=1
timeout 570 python3 -m pytest -q tests/gpu tests/kernels -rfs -p no:cacheprovider > $OUT/gpu_suite_mma.log 2>&1
tail -30 $OUT/gpu_suite_mma.log
