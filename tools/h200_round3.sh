#!/usr/bin/env bash
# GPU tests of kernels/ops/modules, norm tile timings, the layer probe (kernel sequence) and the layer benchmark.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/ops tests/modules -k "not cpu" > $OUT/pytest.log 2>&1
tail -2 $OUT/pytest.log; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head
timeout 60 python3 tools/tune_norm.py 2>&1 | grep "^|"
timeout 150 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 120 python3 -m fp8engine.bench layer --no-torchao --no-compile 2>&1 | grep "^|\|#" | head -7
