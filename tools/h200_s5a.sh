#!/usr/bin/env bash
# Fifth session, batch a: the layer's GEMMs through the rowwise (CUTLASS) dispatch with equal scales and on
# full-range data; host cost of a Triton launch vs its compiled launcher replayed; the layer probe with the
# single-step kernel sequence.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 150 python3 tools/probe_layer.py --skip-sdpa > $OUT/probe.log 2>&1
grep "^|" $OUT/probe.log | head -80
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 60 python3 tools/tune_kernels.py --only host > $OUT/host.log 2>&1
cat $OUT/host.log | tail -15
