"""``--compile``: runs for bf16/fp32 and, at tp = 1, for FP8 (delayed and current scaling); FP8 at tp > 1 is
refused with a one-line usage error (exit 2)."""
import json

import pytest

from fp8engine.train import main

ARGS = ["--steps", "2", "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "4", "--seq-len", "32",
        "--sample-tokens", "0"]


def test_compile_with_fp8_at_tp2_is_refused(tmp_path, capsys):
    assert main(ARGS + ["--compile", "--precision", "fp8", "--tp", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile with --precision fp8 runs at --tp 1 only" in err[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_compile_fp32_runs(tmp_path):
    assert main(ARGS + ["--compile", "--precision", "fp32", "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compile_fp8_matches_eager(tmp_path, recipe):
    """Two steps of the training command, compiled and eager, FP8 with ``recipe``: the same losses (the CPU
    compile uses Inductor here, which may round an FP8 tie differently: bound 1e-3 relative, far below one FP8
    step's effect on a loss of ~5.5)."""
    losses = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        assert main(ARGS + extra + ["--precision", "fp8", "--recipe", recipe, "--out", str(out)]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    assert losses["eager"] and len(losses["eager"]) == len(losses["compiled"])
    for a, b in zip(losses["eager"], losses["compiled"]):
        assert abs(a - b) <= 1e-3 * abs(a), losses
