#!/usr/bin/env bash
# One batched H200 call: GPU tests of the core, the three benchmarks and a profile of the layer.
set -x
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
R=$OUT
timeout 120 python3 -m pytest -q -x tests/fp8 tests/modules -k "not cpu" -p no:cacheprovider > $R/pytest_gpu.log 2>&1; tail -3 $R/pytest_gpu.log
python3 -m fp8engine.bench cast --json $R/cast.json 2>&1 | tail -12
python3 -m fp8engine.bench linear --shapes 8192x4096x16384,4096x4096x4096 --json $R/linear.json 2>&1 | tail -16
python3 -m fp8engine.bench layer --json $R/layer.json 2>&1 | tail -30
python3 tools/profile_layer.py > $R/profile_fp8.txt 2>&1; head -45 $R/profile_fp8.txt
