#!/usr/bin/env bash
# Ran at b6311f9; the direct launch path (kernels/_launch.py, probe_layer --ab-launch) was removed after it.
# Fifth session, batch d: direct Triton launches (kernels/_launch.py): GPU tests of the kernels, host cost per call,
# A/B of the layer step (direct vs kernel[grid], alternated rounds).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -x tests/kernels/test_launch.py tests/kernels/test_cast.py tests/kernels/test_scaling_kernel.py -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 60 python3 tools/tune_kernels.py --only host > $OUT/host.log 2>&1
tail -16 $OUT/host.log
timeout 200 python3 tools/probe_layer.py --ab-launch 4 > $OUT/ab.log 2>&1
tail -12 $OUT/ab.log
