#!/usr/bin/env bash
# One batched call on one H200: the GPU test suite, the single-GPU benchmarks and a profile of the FP8 layer.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
R=runs; mkdir -p $R
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/fp8 tests/ops tests/modules tests/kernels tests/models -k "not cpu" > $R/pytest_gpu.log 2>&1
tail -4 $R/pytest_gpu.log
timeout 40 python3 -m fp8engine.bench cast --json $R/cast.json > $R/bench.log 2>&1
timeout 110 python3 -m fp8engine.bench linear --shapes 8192x4096x16384,8192x16384x4096,4096x4096x4096 --json $R/linear.json >> $R/bench.log 2>&1
timeout 120 python3 -m fp8engine.bench layer --json $R/layer.json >> $R/bench.log 2>&1
timeout 60 python3 tools/profile_layer.py > $R/profile_fp8.txt 2>&1
grep -v "Warning\|warn\|\"\"\"" $R/bench.log
head -40 $R/profile_fp8.txt | cut -c1-70,140-200
tar czf $OUT/results.tgz $R
