"""``python -m fp8engine.bench train --guard-cost`` on the CPU: the code path the lead runs on a GPU to measure
the non-finite guard's cost (numbers here are not the point; that both step objects run and are timed is)."""
import json

import pytest

from fp8engine.bench.train import _GUARD_BLOCK, main


def test_guard_cost_times_both_steps_in_one_process(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--models", "tiny", "--modes", "fp8-delayed", "--steps", "2", "--skip", "1",
                 "--seq-len", "16", "--batch-size", "2", "--guard-cost", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "fp8-delayed" and row["steps_each"] == _GUARD_BLOCK
    assert row["guard_ms"] > 0 and row["no_guard_ms"] > 0
    assert row["guard_cost_pct"] == pytest.approx((row["guard_ms"] / row["no_guard_ms"] - 1) * 100)


def test_guard_cost_refuses_no_guard(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", "--guard-cost", "--no-guard"])
    assert exc.value.code == 2 and "drop --no-guard" in capsys.readouterr().err


def test_rows_are_saved_after_each_mode(tmp_path, monkeypatch):
    """The JSON holds every finished mode before the next one starts (a GPU call stopped by its time limit keeps
    them), and a mode that raises becomes an error row without hiding the others."""
    from fp8engine.bench import train as bench_train

    out = tmp_path / "rows.json"
    seen = []

    def fake_run(model, mode, args):
        if mode == "fp8-delayed":
            seen.append([r["mode"] for r in json.loads(out.read_text())["rows"]])
            raise RuntimeError("boom")
        return {"model": model, "mode": mode, "step_ms": 1.0, "tokens_per_s": 10.0}

    monkeypatch.setattr(bench_train, "_run_mode", fake_run)
    assert main(["--device", "cpu", "--models", "tiny", "--modes", "bf16,fp8-delayed", "--steps", "2", "--skip",
                 "1", "--json", str(out)]) == 1
    assert seen == [["bf16"]]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["bf16", "fp8-delayed"] and "boom" in rows[1]["error"]
