"""The training command under ``torchrun`` on 2 GPUs (NCCL): multi-process runs capture their step in a CUDA graph
and log what the eager step logs. Skipped on machines with fewer than 2 CUDA GPUs (CI, one-GPU machines).

- tensor + sequence parallel, FP8 with dropout (the RNG tracker's forks and the tp collectives inside the graph):
  graphed == ``--no-cuda-graphs``, loss for loss, bit for bit;
- data parallel (the gradient averager's bucketed all-reduces inside the graph): graphed == eager, bit for bit;
- fp32, tp = 2 with sequence parallelism, graphed, against one process: within the CPU tests' bound (rtol 1e-4,
  ``tests/test_train.py::test_tensor_and_data_parallel_runs_match_one_process``: summation order only).
"""
import json

import numpy as np
import pytest
import torch

from _train_cli import run_torchrun, run_train

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

_SMALL = ["--model", "tiny", "--n-layer", "2", "--hidden-size", "256", "--n-head", "4", "--ffn-hidden-size", "1024",
          "--seq-len", "256", "--batch-size", "4", "--eval-iters", "2", "--eval-interval", "4", "--sample-tokens",
          "0", "--steps", "8", "--device", "cuda"]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _torchrun(out, *args) -> tuple[list[float], str]:
    rc, stdout, stderr = run_torchrun(2, *_SMALL, "--out", out, *args, timeout=600)
    assert rc == 0, stderr[-3000:]
    return _losses(out), stdout


@pytest.mark.parametrize("layout", [["--tp", "2", "--sequence-parallel"], ["--tp", "1"]], ids=["tp2-sp", "dp2"])
def test_graphed_multi_process_run_logs_the_eager_losses(tmp_path, layout):
    extra = ["--precision", "fp8", "--dropout", "0.1", *layout]
    graphed, stdout = _torchrun(tmp_path / "graph", *extra)
    assert "CUDA graphs: the training step" in stdout and "is captured" in stdout, stdout[-2000:]
    eager, stdout = _torchrun(tmp_path / "eager", *extra, "--no-cuda-graphs")
    assert "CUDA graphs: off (--no-cuda-graphs)" in stdout
    assert len(graphed) == 8 and graphed == eager  # exact float equality


def test_graphed_tp2_matches_one_process(tmp_path):
    tp, _ = _torchrun(tmp_path / "tp", "--precision", "fp32", "--tp", "2", "--sequence-parallel")
    rc, _, stderr = run_train(*_SMALL, "--precision", "fp32", "--out", tmp_path / "one")
    assert rc == 0, stderr[-3000:]
    np.testing.assert_allclose(tp, _losses(tmp_path / "one"), rtol=1e-4)


def test_fsdp_fp8_run_tracks_the_data_parallel_run(tmp_path):
    """--fsdp (FP8 weights all-gathered as FP8 bytes, parameters all-gathered in bf16) against the replicated
    data-parallel run of the same seed: the same model and batches, the weights reaching the FP8 casts through bf16
    and the weight amaxes taken on the FP8 grid, so the losses agree to FP8's precision (bound 2 %), and the run
    says it is not graphed."""
    dp, _ = _torchrun(tmp_path / "dp", "--precision", "fp8", "--tp", "1")
    fsdp, stdout = _torchrun(tmp_path / "fsdp", "--precision", "fp8", "--fsdp", "--fp8-all-gather")
    assert "CUDA graphs: off (CUDA graphs are not used with --fsdp" in stdout
    np.testing.assert_allclose(fsdp, dp, rtol=2e-2)
