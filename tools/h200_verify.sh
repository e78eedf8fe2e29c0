#!/usr/bin/env bash
# Final check on one H200: the GPU test suite and the layer benchmark (eager rows only) on the current tree.
export PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/fp8 tests/ops tests/modules tests/kernels tests/models -k "not cpu" > $OUT/pytest_gpu.log 2>&1
tail -4 $OUT/pytest_gpu.log
timeout 60 python3 -m fp8engine.bench layer --no-torchao --no-compile --json $OUT/layer.json 2>&1 | grep "^|" | head -6
