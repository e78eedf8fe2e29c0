#!/usr/bin/env bash
# Seventh session, batch a: do cuBLASLt's GELU epilogues (fc1 fprop GELU_AUX_BIAS with FP8 out, fc2 dgrad
# DGELU_BGRAD) accept FP8 and beat _scaled_mm + the Triton activation kernels? Plus the layer's kernel profile.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv
timeout 240 python3 tools/probe_epilogue.py --rounds 5 2>&1 | tail -40
timeout 200 python3 tools/profile_layer.py 2>&1 | head -45
