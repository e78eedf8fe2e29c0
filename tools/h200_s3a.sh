#!/usr/bin/env bash
# Third session, first single-H200 batch: GPU kernel tests, tile sweeps, layer probe, bench cast.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 240 python3 -m pytest -q -x tests/kernels tests/ops -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 150 python3 tools/tune_kernels.py 2>&1 | tee $OUT/tune.log | grep "^|"
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to\|^host" $OUT/probe.log
timeout 60 python3 -m fp8engine.bench cast 2>&1 | grep "^|\|#"
timeout 200 python3 -m pytest -q -x tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests_modules.log 2>&1
tail -3 $OUT/tests_modules.log
