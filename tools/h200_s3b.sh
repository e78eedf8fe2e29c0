#!/usr/bin/env bash
# Third session, second single-H200 batch: targeted GPU tests, kernel timings, layer probe with host profile.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -x tests/kernels/test_qkv_grad_kernel.py tests/kernels/test_activation.py tests/ops -k "not cpu and (cuda or hardware or not kernels)" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 120 python3 tools/tune_kernels.py 2>&1 | tee $OUT/tune.log | grep "^|"
timeout 150 python3 tools/probe_layer.py --skip-gemm --skip-sdpa --host-profile > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to\|^host" $OUT/probe.log
