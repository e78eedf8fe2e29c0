#!/usr/bin/env bash
# Fourth session, batch a: activation GPU tests, activation backward configurations, layer probe; SM clock and
# power logged every 50 ms while the probe runs (nvidia-smi, read only).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $OUT/smi_info.csv 2>&1
timeout 150 python3 -m pytest -q tests/kernels/test_activation.py tests/ops/test_mlp_op.py -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 150 python3 tools/tune_kernels.py --only act > $OUT/tune.log 2>&1
cat $OUT/tune.log
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv,nounits -lms 50 > $OUT/smi_probe.csv 2>&1 &
SMI=$!
timeout 120 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
kill $SMI
grep "^FP8 layer\|^kernels per\|^back-to\|^host\|^single" $OUT/probe.log
