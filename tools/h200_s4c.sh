#!/usr/bin/env bash
# Ran at commit c674ddf (grouped weight cast; removed after batch d showed no gain).
# Fourth session, batch c: after the grouped-cast fixes (aligned scale_inv slots, alignment facts in the kernel):
# GPU tests (cast kernels, activations, modules incl. the CUDA graph test), grouped vs per-weight cast timing, layer
# probe, bench layer (all rows, torchao carried), bench cast, bench linear.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 -m pytest -q tests/kernels/test_grouped_cast.py tests/kernels/test_cast.py tests/kernels/test_activation.py tests/modules -k "not cpu" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
timeout 60 python3 tools/tune_kernels.py --only weights > $OUT/tune.log 2>&1
cat $OUT/tune.log
timeout 100 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to" $OUT/probe.log
timeout 300 python3 -m fp8engine.bench layer --graph --json $OUT/layer.json > $OUT/layer.log 2>&1
grep -v Warning $OUT/layer.log | grep -v '"""'
timeout 60 python3 -m fp8engine.bench cast > $OUT/cast.log 2>&1
cat $OUT/cast.log
