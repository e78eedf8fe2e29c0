#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU, from the repository root, after every change that touches it.
#
#   tools/gpu_check.sh OUT_DIR [tests] [train] [bench] [layer] [all]    (default: all)
#
# tests  the whole test suite (all of tests/, never chosen folders: the CUDA tests of the training command live there;
#        TESTS_SHARD=1/2 then 2/2 splits it over two calls)
# train  the training command on gpt2-124m and 1b, fp8 (graphed and eager) and bf16, a few dozen steps each
# bench  python -m fp8engine.bench train (every precision and mode side by side, both models)
# layer  python -m fp8engine.bench layer and linear (with torchao.float8 when it is importable)
# Every phase writes its log (and JSON where the benchmark has one) into OUT_DIR; the script's status is non-zero
# when any phase failed. Carried wheels (e.g. torchao) in .whl/ are installed to /tmp/site first.
set -uo pipefail
OUT=${1:?usage: tools/gpu_check.sh OUT_DIR [tests] [train] [bench] [layer] [all]}
shift
PHASES=${*:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
status=0
want() { [[ " $PHASES " == *" $1 "* || " $PHASES " == *" all "* ]]; }
phase() {  # phase NAME COMMAND...: run, tee to OUT/NAME.log, remember failure
  local name=$1; shift
  local cmd="$*"
  echo "=== $name: ${cmd:0:300}" | tee -a "$OUT/summary.txt"  # (a shard's test ids cut short)
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tr '\r' '\n' < "$OUT/$name.log" | grep -av "step/s\|it/s\|^\s*$" | tail -n 15  # progress bars left out
  [ "$rc" -eq 0 ] || status=1
}
python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import torch, triton
print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())
EOF
cat "$OUT/env.txt"
if want tests; then
  # pytest-xdist and pytest-timeout when installed (carry their wheels in .whl/): the suite spread over 15 workers
  # (16 CPU cores on the H100 machine), no test hangs the check. TESTS_SHARD=i/n runs every n-th test from the i-th
  # (1/2 and 2/2 in two device calls cover all of tests/ when one call's 10 minutes are not enough).
  extra=()
  python3 -c "import xdist" 2>/dev/null && extra+=(-n "${PYTEST_WORKERS:-15}")
  # One intra-op CPU thread per worker: torch's default (one per core) times 15 workers oversubscribed the 16 cores
  # 15-fold, and the CPU-tensor tests crawled (a 40-step fp32 CPU training test took 166 s, H100 machine, -n 15).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # <seconds> <phase:outcome> <test id> per test as it finishes (tests/conftest.py), kept even when a call is cut
  export FP8ENGINE_TEST_DURATIONS="$OUT/test_durations.txt"
  python3 -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 300)
  targets=(tests)
  if [ -n "${TESTS_SHARD:-}" ]; then
    # every n-th test id from the i-th (not every n-th file: a few files of many parametrised kernel tests hold
    # most of the GPU time, and test ids spread them over the shards)
    IFS=/ read -r i n <<< "$TESTS_SHARD"
    python3 -m pytest --collect-only -q -p no:cacheprovider tests 2>/dev/null | grep -a '::' > "$OUT/test_ids.txt"
    mapfile -t targets < <(awk -v i="$i" -v n="$n" '(NR - 1) % n == i - 1' "$OUT/test_ids.txt")
    echo "shard $TESTS_SHARD: ${#targets[@]} of $(wc -l < "$OUT/test_ids.txt") tests" | tee -a "$OUT/summary.txt"
  fi
  phase tests python3 -m pytest -q -rfE --maxfail=15 -p no:cacheprovider --durations=25 "${extra[@]}" "${targets[@]}"
  sort -rn "$FP8ENGINE_TEST_DURATIONS" | head -n 12 >> "$OUT/summary.txt"
  grep -a "FAILED\|ERROR" "$OUT/tests.log" | grep -av "^E " | sort -u | head -40 >> "$OUT/summary.txt"
fi
if want train; then
  # gpt2-124m writes its run folder (metrics, checkpoint, plot); 1b only logs (its checkpoint is ~16 GB).
  for model in gpt2-124m 1b; do
    bs=16; [ "$model" = 1b ] && bs=4
    for mode in "fp8" "fp8 --recipe current" "fp8 --no-cuda-graphs" "bf16"; do
      tag="train_${model}_$(echo "$mode" | tr -d ' -')"
      out=(); [ "$model" = gpt2-124m ] && out=(--out "$OUT/$tag")
      # shellcheck disable=SC2086
      phase "$tag" python3 -m fp8engine.train --device cuda --model "$model" --batch-size "$bs" --precision $mode \
        --steps 30 --eval-interval 15 --eval-iters 4 --sample-tokens 32 "${out[@]}"
      grep -ao "step [0-9]*: train loss [0-9.]*, val loss [0-9.]*" "$OUT/$tag.log" | tail -n 1 >> "$OUT/summary.txt"
      rm -f "$OUT/$tag"/checkpoint*.pt
    done
  done
fi
if want bench; then
  phase bench_train python3 -m fp8engine.bench train --json "$OUT/bench_train.json"
fi
if want layer; then
  # [s, b, h], ffn, heads: the performance guide's layer, the 1b and gpt2-124m layers, and a host-bound small one.
  for shape in "2048 4 4096 16384 32" "2048 4 2048 8192 16" "1024 16 768 3072 12" "128 1 256 1024 4"; do
    read -r s b h f n <<< "$shape"
    phase "bench_layer_${h}" python3 -m fp8engine.bench layer --seq "$s" --batch "$b" --hidden "$h" --ffn "$f" \
      --heads "$n" --graph --json "$OUT/bench_layer_${h}.json"
  done
  phase bench_linear python3 -m fp8engine.bench linear --json "$OUT/bench_linear.json"
fi
exit $status
