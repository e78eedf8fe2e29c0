#!/usr/bin/env bash
# Ran at commit 69852cc (grouped weight cast; removed after batch d showed no gain).
# Fourth session, batch b: GPU tests of the grouped weight cast (kernel and modules), kernel timings (back-to-back),
# layer probe, bench layer (all rows, torchao carried) and bench cast; SM clock logged during the benches.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q tests/kernels/test_grouped_cast.py tests/kernels/test_cast.py tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 100 python3 tools/tune_kernels.py --only act > $OUT/tune.log 2>&1
timeout 60 python3 tools/tune_kernels.py --only weights >> $OUT/tune.log 2>&1
cat $OUT/tune.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,nounits -lms 100 > $OUT/smi.csv 2>&1 &
SMI=$!
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 300 python3 -m fp8engine.bench layer --graph --json $OUT/layer.json > $OUT/layer.log 2>&1
cat $OUT/layer.log
timeout 60 python3 -m fp8engine.bench cast > $OUT/cast.log 2>&1
cat $OUT/cast.log
kill $SMI
