"""The training command's FP8 health record (``--fp8-stats N``, fp8engine.training.fp8_health): the metrics.jsonl
schema round trip, the picture, and a run of the command that records every 2nd step without changing the run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.stats import FP8StatsRow, fp8_stats, fp8_stats_recording
from fp8engine.modules import LayerNormMLP, Linear
from fp8engine.training.fp8_health import STATS_KEY, plot_fp8_health, rows_from_json, rows_to_json
from fp8engine.training.metrics import MetricsLog, read_metrics

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
#: the documented fields of one fp8_stats object (README, fp8engine/training/fp8_health.py)
SCHEMA = {"module", "role", "format", "amax", "scale", "underflow_pct", "saturation_pct"}


def _recorded_rows():
    """Rows of a real model: a LayerNormMLP counted in one step, a Linear never run (its rows are 'not counted')."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"mlp": LayerNormMLP(32, 64), "idle": Linear(32, 16)})
    x = torch.randn(5, 3, 32, requires_grad=True)
    with fp8_stats_recording(model):
        with fe.autocast():
            y = model["mlp"](x)
        y.sum().backward()
    return fp8_stats(model)


def test_metrics_schema_round_trip(tmp_path):
    rows = _recorded_rows()
    assert any(r.amax is None for r in rows) and any(r.amax is not None for r in rows)
    log = MetricsLog(tmp_path)
    log.log({"step": 1, "loss": 5.0})
    log.log({"step": 2, "loss": 4.5, STATS_KEY: rows_to_json(rows)})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one JSON line per step, the stats inside the step's object
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert STATS_KEY not in records[0] and records[1]["loss"] == 4.5
    assert all(set(item) == SCHEMA for item in records[1][STATS_KEY])
    back = rows_from_json(records[1][STATS_KEY])
    assert back == rows and all(isinstance(r, FP8StatsRow) for r in back)
    assert [(r.module, r.role) for r in back][:2] == [("mlp", "fc1_input"), ("mlp", "fc1_weight")]
    with pytest.raises(KeyError):
        rows_from_json([{"module": "m", "role": "input"}])


def test_plot_from_records(tmp_path):
    rows = rows_to_json(_recorded_rows())
    later = rows + [dict(rows[0], module="late", underflow_pct=None, saturation_pct=None, amax=None)]
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, STATS_KEY: rows},
               {"step": 4, "loss": 3.0, STATS_KEY: later}]
    assert plot_fp8_health(records, tmp_path / "h.png", title="t")
    assert (tmp_path / "h.png").read_bytes()[:8] == PNG
    assert not plot_fp8_health(records[:1], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def test_command_records_every_n_steps_without_changing_the_run(tmp_path):
    """``--fp8-stats 2`` on the tiny model: steps 2 and 4 carry 24 rows (2 layers x 12 roles), all counted, the
    picture is written, and the losses are those of the same run without stats (on the CPU the recording path
    casts exactly as the normal one)."""
    common = ["--steps", "5", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "3", "--eval-iters", "1",
              "--sample-tokens", "0", "--device", "cpu"]
    runs = {name: tmp_path / name for name in ("stats", "plain")}
    procs = {name: subprocess.Popen([sys.executable, "-m", "fp8engine.train", *common, "--out", str(out),
                                     *(["--fp8-stats", "2"] if name == "stats" else [])],
                                    cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, out in runs.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        if name == "stats":
            assert "FP8 stats: every 2 steps" in stdout and "fp8_health.png" in stdout
    records = read_metrics(runs["stats"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records if STATS_KEY in r] == [2, 4]
    for r in records:
        if STATS_KEY not in r:
            continue
        rows = rows_from_json(r[STATS_KEY])
        assert len(rows) == 24 and {row.module for row in rows} >= {"layers.0.layernorm_mlp",
                                                                      "layers.1.self_attention.proj"}
        for row in rows:
            assert row.format == ("e5m2" if row.role.endswith("grad_output") else "e4m3"), row
            assert row.amax > 0 and row.scale > 0 and 0 <= row.underflow_pct <= 100 and 0 <= row.saturation_pct <= 100
    assert (runs["stats"] / "fp8_health.png").read_bytes()[:8] == PNG
    assert not (runs["plain"] / "fp8_health.png").exists()
    plain = read_metrics(runs["plain"] / "metrics.jsonl")
    assert [r["loss"] for r in records] == [r["loss"] for r in plain]
    assert all(STATS_KEY not in r for r in plain)
