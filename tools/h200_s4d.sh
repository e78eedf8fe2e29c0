#!/usr/bin/env bash
# Ran at commit 5598412 (the A/B option of probe_layer was removed with the grouped weight cast afterwards).
# Fourth session, batch d: module / graph GPU tests (cut short by the time limit in batch c), grouped weight cast
# A/B in one process, host cost per launcher call.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -x tests/modules tests/kernels/test_grouped_cast.py -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 200 python3 tools/probe_layer.py --ab-prefetch > $OUT/ab.log 2>&1
cat $OUT/ab.log
timeout 60 python3 tools/tune_kernels.py --only host > $OUT/host.log 2>&1
cat $OUT/host.log
