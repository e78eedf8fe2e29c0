#!/usr/bin/env bash
# One batched call on the 4 x H200 kind: TP numerics + bench at tp=4 first (all GPUs), then in parallel:
# GPU0 single-GPU benchmarks, GPU1 GPU tests + JAX bench then tp=2 (GPUs 0,1), GPUs 2/3 the small-GPT trainings.
# Everything lands in runs/ and comes back as $OUT/results.tgz (checkpoints left out).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
R=runs; mkdir -p $R; T0=$(date +%s)
stamp() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi -L; python3 -c "import torch, triton, jax; print(torch.__version__, triton.__version__, jax.__version__)"; } > $R/env.txt 2>&1
stamp tp4; timeout 100 torchrun --nproc-per-node 4 tools/tp_numerics.py > $R/tp4.log 2>&1
timeout 80 torchrun --nproc-per-node 4 -m fp8engine.bench layer --tp 4 --json $R/layer_tp4.json >> $R/tp4.log 2>&1
stamp train
TRAIN="--data .data/tinyshakespeare.txt --model small --steps 5000 --batch-size 64 --dropout 0.2 --lr 1e-3 --eval-interval 500 --eval-iters 20 --device cuda --sample-tokens 300"
CUDA_VISIBLE_DEVICES=2 timeout -s INT 420 python3 -m fp8engine.train $TRAIN --precision bf16 --out $R/small_bf16 > $R/train_bf16.log 2>&1 &
TB=$!
CUDA_VISIBLE_DEVICES=3 timeout -s INT 420 python3 -m fp8engine.train $TRAIN --precision fp8 --out $R/small_fp8 > $R/train_fp8.log 2>&1 &
TF=$!
( CUDA_VISIBLE_DEVICES=1 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/fp8 tests/ops tests/modules tests/kernels -k "not cpu" > $R/pytest_gpu.log 2>&1
  CUDA_VISIBLE_DEVICES=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python3 -m fp8engine.bench jax --json $R/jax.json > $R/bench_jax.log 2>&1 ) &
TG=$!
( export CUDA_VISIBLE_DEVICES=0
  timeout 40 python3 -m fp8engine.bench cast --json $R/cast.json
  timeout 120 python3 -m fp8engine.bench linear --shapes 8192x4096x16384,8192x16384x4096,4096x4096x4096 --json $R/linear.json
  timeout 120 python3 -m fp8engine.bench layer --json $R/layer.json
  timeout 60 python3 tools/tune_cast_transpose.py ) > $R/bench_single.log 2>&1
stamp single-done; wait $TG; stamp tests-done
timeout 70 torchrun --nproc-per-node 2 tools/tp_numerics.py > $R/tp2.log 2>&1
timeout 60 torchrun --nproc-per-node 2 -m fp8engine.bench layer --tp 2 --json $R/layer_tp2.json >> $R/tp2.log 2>&1
stamp tp2-done; wait $TB $TF; stamp train-done
tar czf $OUT/results.tgz --exclude='*.pt' --exclude='checkpoint*' $R
tail -5 $R/pytest_gpu.log; tail -25 $R/bench_single.log | head -5; tail -3 $R/train_*.log; cat $R/tp2.log | grep "^|" | head -12
