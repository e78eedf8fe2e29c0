#!/usr/bin/env bash
# Fifth session, batch f (final tree): GPU tests of the kernels the PTX conversion touches, bench layer (all rows,
# torchao carried), bench cast, bench linear.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 190 python3 -m pytest -q tests/kernels/test_activation.py tests/kernels/test_qkv_grad_kernel.py tests/kernels/test_fp8_conversion.py -k "cuda or ptx or hardware" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
timeout 270 python3 -m fp8engine.bench layer --graph --json $OUT/layer.json > $OUT/layer.log 2>&1
grep "^|\|^#" $OUT/layer.log
timeout 50 python3 -m fp8engine.bench cast > $OUT/cast.log 2>&1
grep "^|" $OUT/cast.log
timeout 60 python3 -m fp8engine.bench linear --shapes 8192x4096x16384 > $OUT/linear.log 2>&1
grep "^|" $OUT/linear.log
