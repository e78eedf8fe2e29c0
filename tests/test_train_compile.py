"""``--compile``: runs for bf16/fp32; refused with a one-line usage error (exit 2) for FP8."""
import pytest

from fp8engine.train import main

ARGS = ["--steps", "2", "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "4", "--seq-len", "32",
        "--sample-tokens", "0"]


def test_compile_with_fp8_is_refused(tmp_path, capsys):
    assert main(ARGS + ["--compile", "--precision", "fp8", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile is not supported with --precision fp8" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_compile_fp32_runs(tmp_path):
    assert main(ARGS + ["--compile", "--precision", "fp32", "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "metrics.jsonl").exists()
