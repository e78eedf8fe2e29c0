#!/usr/bin/env bash
# Third session, third single-H200 batch: GEMM GPU tests, wgrad GEMM sweep, bench layer / cast / linear.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -x tests/kernels/test_gemm_kernel.py tests/modules/test_linear.py -k "cuda" -p no:cacheprovider > $OUT/tests.log 2>&1
tail -2 $OUT/tests.log
timeout 150 python3 tools/tune_kernels.py --only gemm 2>&1 | tee $OUT/tune.log | grep "^|"
timeout 280 python3 -m fp8engine.bench layer --graph 2>&1 | tee $OUT/layer.log | grep "^|\|#"
timeout 60 python3 -m fp8engine.bench cast 2>&1 | grep "^|\|#"
