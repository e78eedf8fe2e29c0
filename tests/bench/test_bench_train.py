"""``python -m fp8engine.bench train --guard-cost`` on the CPU: the code path the lead runs on a GPU to measure
the non-finite guard's cost (numbers here are not the point; that both step objects run and are timed is)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from _train_cli import free_port, train_env

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
        return {"model": model, "mode": mode, "layout": "1 GPU", "step_ms": 1.0, "tokens_per_s": 10.0,
                "tokens_per_s_per_gpu": 10.0}

    monkeypatch.setattr(bench_train, "_run_mode", fake_run)
    assert main(["--device", "cpu", "--models", "tiny", "--modes", "bf16,fp8-delayed", "--steps", "2", "--skip",
                 "1", "--json", str(out)]) == 1
    assert seen == [["bf16"]]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["bf16", "fp8-delayed"] and "boom" in rows[1]["error"]


def test_default_data_is_gpt2_vocabulary(tmp_path):
    """Without --data the rows are timed on GPT-2's padded vocabulary (random ids < 50257), not on bytes."""
    from fp8engine.bench.train import random_gpt2_bins

    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--models", "tiny", "--modes", "fp8-delayed", "--steps", "2", "--skip", "1",
                 "--seq-len", "16", "--batch-size", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["vocab"] == 50304 and row["layout"] == "1 GPU"
    assert row["tokens_per_s"] == pytest.approx(2 * 16 / (row["step_ms"] / 1e3))
    ids = np.fromfile(random_gpt2_bins(str(tmp_path)) + "/train.bin", dtype=np.uint16)
    assert ids.max() < 50257 and len(np.unique(ids[:100000])) > 40000  # all of GPT-2's ids, spread


@pytest.mark.slow
@pytest.mark.parametrize("layout,name", [(["--tp", "2", "--sequence-parallel"], "tp2-sp"), ([], "dp2"),
                                         (["--fsdp"], "fsdp2")])
def test_bench_train_under_torchrun(tmp_path, layout, name):
    """2 gloo processes: one row per mode from rank 0, in the layout asked for, tokens counted over the global
    batch (dp replicas each run --batch-size) and per GPU."""
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "fp8engine.bench", "train", "--device", "cpu", "--models",
           "tiny", "--modes", "bf16,fp8-delayed", "--steps", "2", "--skip", "1", "--seq-len", "16", "--batch-size",
           "2", "--vocab", "bytes", "--json", str(out), *layout]
    proc = subprocess.run(cmd, env=train_env(one_thread=True), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["bf16", "fp8-delayed"] and {r["layout"] for r in rows} == {name}
    replicas = 1 if name == "tp2-sp" else 2
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(replicas * 2 * 16 / (r["step_ms"] / 1e3))
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
    assert proc.stdout.count("fp8-delayed:") == 1  # rank 0 reports, rank 1 is quiet


def test_plain_pytorch_peer_rows(tmp_path):
    """The plain PyTorch GPT peer (fp8engine.bench.plain_gpt) is timed beside the command's modes on the same data
    and batch: same parameter count as the command's GPT of that config, one row each."""
    from fp8engine.bench.plain_gpt import PlainGPT
    from fp8engine.models import GPT, GPTConfig

    for config in (GPTConfig(), GPTConfig(num_gqa_groups=2, normalization="RMSNorm", activation="swiglu")):
        assert sum(p.numel() for p in PlainGPT(config).parameters()) == GPT(config).num_params()
    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--models", "tiny", "--modes", "bf16,plain-bf16", "--steps", "2", "--skip",
                 "1", "--seq-len", "16", "--batch-size", "2", "--vocab", "bytes", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["bf16", "plain-bf16"] and all("error" not in r for r in rows)
    assert abs(rows[1]["loss_first"] - rows[0]["loss_first"]) < 1.0  # the same task at init, another init


def test_train_args_reach_the_command(tmp_path, capsys):
    """--train-args adds the training command's own options to every mode (here --dropout: the two rows' losses
    differ only through it); a bad option is the command's usage error (exit 2)."""
    common = ["--device", "cpu", "--models", "tiny", "--modes", "bf16", "--steps", "2", "--skip", "1", "--seq-len",
              "16", "--batch-size", "2", "--vocab", "bytes"]
    rows = []
    for extra in ([], ["--train-args", "--dropout 0.5"]):
        out = tmp_path / f"rows{len(rows)}.json"
        assert main([*common, *extra, "--json", str(out)]) == 0
        rows.append(json.loads(out.read_text())["rows"][0])
    assert rows[0]["loss_first"] != rows[1]["loss_first"]
    with pytest.raises(SystemExit) as exc:
        main([*common, "--train-args", "--no-such-option"])
    assert exc.value.code == 2


def test_a_failing_rank_stops_the_multi_process_run(capsys):
    """Under torchrun a mode that raises on any rank is reported on stderr with the rank and ends the run (the
    other ranks wait in that mode's collectives; going on to the next mode would hang them all, and a rank other
    than 0 prints its rows to /dev/null)."""
    from types import SimpleNamespace

    from fp8engine.bench import train as bench_train

    args = SimpleNamespace(layout=SimpleNamespace(world_size=2, rank=1))

    def fake_run(model, mode, args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        bench_train._rows(["8b"], ["bf16", "fp8-delayed"], fake_run, lambda row: None, args)
    assert "[rank 1]  8b bf16: FAILED: OutOfMemoryError: CUDA out of memory" in capsys.readouterr().err
