#!/usr/bin/env bash
# Seventh session, batch b: the fc1 GELU_AUX_BIAS epilogue with C no longer aliased to the FP8 D (status 7 in s7a).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 tools/probe_epilogue.py --rounds 5 2>&1 | tail -20
