#!/usr/bin/env bash
# Third session: re-run of the norm kernel GPU tests after the tolerance fix, module GPU tests, layer probe.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q tests/kernels/test_norm_kernels.py tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
