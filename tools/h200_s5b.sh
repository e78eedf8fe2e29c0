#!/usr/bin/env bash
# Fifth session, batch b: host cost of a Triton launch vs its compiled launcher replayed; host timeline of one
# layer step (torch profiler CPU ops) and cProfile.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 60 python3 tools/tune_kernels.py --only host > $OUT/host.log 2>&1
tail -15 $OUT/host.log
timeout 150 python3 tools/probe_layer.py --skip-sdpa --skip-gemm --host-profile > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to\|^host issue" $OUT/probe.log
