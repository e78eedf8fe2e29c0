"""examples/hf_finetune.py: CLI conventions, and a few FP8 steps on the CPU in a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "hf_finetune.py"


def _run(*argv, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_exits_0():
    proc = _run("--help")
    assert proc.returncode == 0 and "--model-path" in proc.stdout and "llama-1b" in proc.stdout


@pytest.mark.parametrize("argv, phrase", [(["--steps", "0"], "--steps must be >= 1"),
                                          (["--model", "nope"], "invalid choice"),
                                          (["--data", "/no/such/file.txt"], "no such file")])
def test_bad_flags_one_line_exit_2(argv, phrase):
    proc = _run(*argv)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and phrase in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_fp8_steps_on_cpu(model, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("To be, or not to be, that is the question. " * 40)
    steps = 3
    proc = _run("--model", model, "--steps", str(steps), "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
                "--precision", "fp8", "--data", str(data), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "layers converted to FP8" in proc.stdout and "kept  lm_head" in proc.stdout
    assert f"data: {data}" in proc.stdout
    last = proc.stdout.strip().splitlines()[-2]  # the "wrote ..." line comes after it
    assert "median tokens/s" in last and "fp8, eager, cpu" in last
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert abs(records[0]["loss"] - 5.545) < 0.3  # ln(256): a random-init byte model starts near uniform
