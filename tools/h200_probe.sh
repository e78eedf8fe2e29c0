#!/usr/bin/env bash
# One batched call on one H200: where the FP8 layer's time goes (tools/probe_layer.py) and the layer benchmark.
export PYTHONUNBUFFERED=1
timeout 240 python3 tools/probe_layer.py "$@" 2>&1 | grep -v "Warning\|warn(" | cut -c1-200
timeout 120 python3 -m fp8engine.bench layer --no-torchao --no-compile --graph 2>&1 | grep "^|\|#"
