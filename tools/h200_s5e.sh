#!/usr/bin/env bash
# Fifth session, batch e: FP8 conversion by inline PTX in the tiled kernels that write a transposed copy
# (activation backward, cast-transpose of fp32 / ragged tiles): bit checks against torch, GPU tests, timing.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 60 python3 -m pytest -q -x tests/kernels/test_fp8_conversion.py -k "ptx" -p no:cacheprovider > $OUT/t1.log 2>&1
tail -3 $OUT/t1.log
timeout 100 python3 -m pytest -q -x tests/kernels/test_activation.py -k "hardware_conversion or (bwd and cuda)" -p no:cacheprovider > $OUT/t2.log 2>&1
tail -3 $OUT/t2.log
timeout 90 python3 tools/tune_kernels.py --only act > $OUT/act.log 2>&1
tail -14 $OUT/act.log
timeout 80 python3 tools/probe_layer.py --skip-gemm --skip-sdpa > $OUT/probe.log 2>&1
grep "^FP8 layer\|^kernels per\|^back-to\|act_bwd" $OUT/probe.log | head -8
