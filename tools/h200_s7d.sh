#!/usr/bin/env bash
# Seventh session, batch d (fc1 GELU epilogue in; its A/B row "no epilogue" in the same run): bench layer and bench linear,
# rows interleaved over 3 rounds, GPU temperature / power / clocks / clock-event reasons sampled every second.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
Q=timestamp,temperature.gpu,temperature.memory,power.draw,clocks.sm,clocks.mem
if nvidia-smi --query-gpu=$Q,clocks_event_reasons.active --format=csv,noheader > /dev/null 2>&1; then
  Q=$Q,clocks_event_reasons.active; else Q=$Q,clocks_throttle_reasons.active; fi
nvidia-smi --query-gpu=$Q --format=csv -lms 1000 > $OUT/smi.csv 2>&1 &
SMI=$!
timeout 420 python3 -m fp8engine.bench layer --graph --rounds 3 --json $OUT/layer.json > $OUT/layer.log 2>&1
grep "^|\|^#" $OUT/layer.log
timeout 120 python3 -m fp8engine.bench linear --shapes 8192x4096x16384 --rounds 3 > $OUT/linear.log 2>&1
grep "^|" $OUT/linear.log
kill $SMI
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/smi.csv")))
print(rows[0]); print(len(rows) - 1, "samples")
for r in rows[1::10]: print(r)
PY
