#!/usr/bin/env bash
# Fourth session, batch e (final tree): GPU tests of the changed kernels and the modules, layer probe, bench layer
# (all rows, torchao carried), bench cast, bench linear.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 110 python3 -m pytest -q -x tests/kernels/test_activation.py tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
timeout 80 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 260 python3 -m fp8engine.bench layer --graph --json $OUT/layer.json > $OUT/layer.log 2>&1
grep "^|\|^#" $OUT/layer.log
timeout 50 python3 -m fp8engine.bench cast > $OUT/cast.log 2>&1
grep "^|" $OUT/cast.log
timeout 60 python3 -m fp8engine.bench linear --shapes 8192x4096x16384 > $OUT/linear.log 2>&1
grep "^|" $OUT/linear.log
