"""The training command: data and batches, LR schedule, a learning run, exact resume, bad-input exits."""
import pickle

import numpy as np
import pytest
import torch

from fp8engine.train import lr_at, main
from fp8engine.training.data import batch_seed, get_batch, load_data
from fp8engine.training.metrics import read_metrics
from tests._train_cli import run_torchrun, run_train

# Small and quick: the tiny model's shape at a short context and batch.
QUICK = ["--batch-size", "4", "--seq-len", "32", "--eval-iters", "2", "--sample-tokens", "0"]
# Multi-process runs here are gloo ranks on the CPU (a one-GPU machine has no cuda:1 for rank 1).
GLOO = ["--device", "cpu"]


_cli = run_train


# ----------------------------------------------------------------------------------------------- data, schedule

def test_lr_schedule():
    peak, warm, total = 1e-3, 10, 110
    assert lr_at(1, peak, warm, total) == pytest.approx(1e-4)
    assert lr_at(10, peak, warm, total) == pytest.approx(peak)
    assert lr_at(60, peak, warm, total) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert lr_at(110, peak, warm, total) == pytest.approx(0.1 * peak)
    lrs = [lr_at(s, peak, warm, total) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    x1, y1 = get_batch(tokens, 8, 33, batch_seed(1, "train", 5, 0))
    x2, y2 = get_batch(tokens, 8, 33, batch_seed(1, "train", 5, 0))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (8, 33) and x1.dtype == torch.int64
    torch.testing.assert_close(x1[:, 1:], y1[:, :-1], rtol=0, atol=0)  # targets are the next tokens
    for other in (batch_seed(1, "train", 6, 0), batch_seed(1, "train", 5, 1), batch_seed(2, "train", 5, 0),
                  batch_seed(1, "val", 5, 0)):
        assert not torch.equal(x1, get_batch(tokens, 8, 33, other)[0])


def test_load_text_and_stdlib(text_file):
    data = load_data(str(text_file))
    assert data.vocab_size == 256 and len(data.train) + len(data.val) == 40_000
    assert len(data.val) == 4000  # the held-out last 10 %
    assert data.decode(data.encode("héllo")) == "héllo"
    default = load_data(None)
    assert "standard library" in default.description and len(default.train) > 100_000
    assert b"def " in bytes(default.train[:50_000])


def test_load_token_bins(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 3000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 65, 500).astype(np.uint16).tofile(tmp_path / "val.bin")
    data = load_data(str(tmp_path))
    assert data.vocab_size == 50304 and data.decode is None and len(data.train) == 3000
    chars = [chr(ord("A") + i) for i in range(65)]
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    data = load_data(str(tmp_path))
    assert data.vocab_size == 65 and data.decode(data.encode("ABC")) == "ABC"


def test_token_bins_train_and_sample(tmp_path, capsys):
    """A nanoGPT-style token directory trains end to end, with the vocabulary from meta.pkl and a decoded sample."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 600)):
        rng.integers(0, 65, n).astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    chars = [chr(ord("0") + i) for i in range(65)]
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}},
                    f)
    args = ["--data", tmp_path, "--steps", "3", *QUICK[:-2], "--sample-tokens", "12", "--precision", "fp32"]
    assert main(list(map(str, args))) == 0
    sample = capsys.readouterr().out.split("---\n")[1].splitlines()[0]
    assert len(sample) == 12 and set(sample) <= set(chars)


# ------------------------------------------------------------------------------------------------ runs

def test_default_run_learns(tmp_path):
    """The no-option command (FP8, tiny model, standard-library bytes), shortened: progress bar with loss,
    tokens/s and lr; metrics, loss.png and a checkpoint in --out; validation; a sample; the loss falls."""
    out = tmp_path / "run"
    rc, stdout, stderr = _cli("--steps", "40", "--batch-size", "8", "--seq-len", "64", "--eval-interval", "20",
                              "--eval-iters", "2", "--sample-tokens", "40", "--out", out)
    assert rc == 0, stderr
    assert "fp8" in stdout and "--- sample" in stdout
    assert "loss=" in stderr and "tok_s=" in stderr and "lr=" in stderr
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in records)
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    losses = [r["loss"] for r in records]
    assert losses[0] > 5.0  # ~ln(256) = 5.55 at initialisation
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 40 and {"model", "optimizer", "rng", "data_position", "settings"} <= ckpt.keys()
    assert any(k.endswith("amax_history") for k in ckpt["model"])  # FP8 scaling state is checkpointed


def _losses(out):
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.parametrize("precision,recipe", [("fp32", "delayed"), ("fp8", "delayed"), ("fp8", "current")])
def test_resume_is_exact(tmp_path, text_file, precision, recipe):
    """Stopped at step 5 and resumed to 10 == an uninterrupted 10-step run, loss for loss (dropout on, so the
    RNG state must be restored too; grad-accum 2 exercises FP8 weight caching)."""
    common = ["--data", text_file, "--steps", "10", "--eval-interval", "3", "--dropout", "0.1", "--grad-accum", "2",
              "--precision", precision, "--recipe", recipe, *QUICK]
    common = list(map(str, common))
    assert main(common + ["--out", str(tmp_path / "full")]) == 0
    assert main(common + ["--out", str(tmp_path / "split"), "--stop-at", "5"]) == 0
    assert [s for s, _, _ in _losses(tmp_path / "split")] == [1, 2, 3, 4, 5]
    assert main(common + ["--out", str(tmp_path / "split"), "--resume"]) == 0
    full, split = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert len(full) == 10 and sum(v is not None for _, _, v in full) == 4  # evals at 3, 6, 9, 10
    assert split == full  # exact float equality


def test_resume_refuses_a_different_run(tmp_path, text_file, capsys):
    args = ["--data", str(text_file), "--steps", "4", "--precision", "fp32", *QUICK, "--out", str(tmp_path)]
    assert main(args + ["--stop-at", "2"]) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main(args + ["--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--lr" in err and err.count("\n") == 1
    assert main(args) == 2  # a fresh run into a directory holding a checkpoint
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


# --------------------------------------------------------------------------------------------- bad input

def _bad_cases(tmp):
    empty = tmp / "empty.txt"
    empty.write_text("")
    short = tmp / "short.txt"
    short.write_text("x" * 100)
    cases = {
        "missing data": (["--data", tmp / "nope.txt"], "no such file"),
        "empty data": (["--data", empty], "empty"),
        "seq-len longer than data": (["--data", short, "--seq-len", "64"], "--seq-len"),
        "dims not FP8-capable": (["--hidden-size", "72", "--ffn-hidden-size", "288"], "multiple of 16"),
        "resume without checkpoint": (["--resume"], "no checkpoint"),
    }
    if not torch.cuda.is_available():
        cases["cuda without GPU"] = (["--device", "cuda"], "--device cpu")
    return cases


@pytest.mark.parametrize("case", ["missing data", "empty data", "seq-len longer than data", "dims not FP8-capable",
                                  "resume without checkpoint", "cuda without GPU"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    """The command's entry point in this process (a fresh interpreter per case cost the suite ~19 s on the 2-core
    CI machine; tests/test_train_reliability.py runs a bad flag through ``python -m fp8engine.train``)."""
    cases = _bad_cases(tmp_path)
    if case not in cases:
        pytest.skip("a GPU is visible")
    args, message = cases[case]
    out = tmp_path / "out"
    rc = main([*map(str, args), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert rc == 2, stderr
    assert "Traceback" not in stderr and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8engine.train: error:")
    assert message in lines[0]
    assert not out.exists()  # nothing written to --out


def test_seq_len_beyond_the_models_context_warns_and_trains(text_file, capsys):
    """Positions are rotary, so a --seq-len longer than the named model's context builds the model for it and
    trains; the command says so in one line on stderr (flags.seq_len_warning), and says nothing at the context."""
    common = ["--data", str(text_file), "--steps", "1", "--batch-size", "2", "--eval-iters", "1", "--sample-tokens",
              "0", "--precision", "fp32"]
    assert main(common + ["--seq-len", "160"]) == 0
    stdout, stderr = capsys.readouterr()
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("fp8engine.train: warning: --seq-len 160 is longer than "
                                                         "the tiny model's context (128)")
    assert "--seq-len 128 or less" in warnings[0]
    assert "x 160 tokens" in stdout  # the run used the longer context
    assert main(common + ["--seq-len", "128"]) == 0
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- CPU settings

def test_denormal_flush_keeps_the_losses_and_can_be_turned_off(tmp_path, text_file, monkeypatch):
    """The command flushes CPU denormals to zero (fp8engine/_cpu.py: 16-18 % less training time for the default run on
    the 2-core CI machine) and logs bit-identical losses with and without it; FP8ENGINE_FLUSH_DENORMAL=0 turns it off.
    Fresh interpreters: the setting reaches torch's thread pool only when made before the pool starts."""
    # --device cpu: the setting is a CPU one (a GPU run says nothing of denormals)
    args = ["--device", "cpu", "--data", text_file, "--steps", "8", "--eval-interval", "4", *QUICK]
    runs = {}
    for value in (None, "0"):
        if value is None:
            monkeypatch.delenv("FP8ENGINE_FLUSH_DENORMAL", raising=False)
        else:
            monkeypatch.setenv("FP8ENGINE_FLUSH_DENORMAL", value)
        out = tmp_path / f"flush_{value}"
        rc, stdout, stderr = run_train(*args, "--out", out)
        assert rc == 0, stderr
        runs[value] = stdout, _losses(out)
    assert "CPU denormals: flushed to zero" in runs[None][0]
    assert "CPU denormals: kept" in runs["0"][0]
    assert len(runs[None][1]) == 8 and runs[None][1] == runs["0"][1]  # exact float equality, evaluations included


# --------------------------------------------------------------------------------------------- multi-process

def _torchrun(nproc, *args):
    rc, _, stderr = run_torchrun(nproc, *args, timeout=300)
    assert rc == 0, stderr[-3000:]


@pytest.mark.slow
def test_tensor_and_data_parallel_runs_match_one_process(tmp_path, text_file):
    """2 gloo processes as tp=2 with sequence parallelism, and as dp=2, log the losses of the same run in one
    process (fp32; up to summation order); the dp run also resumes from its per-rank checkpoint."""
    common = ["--data", text_file, "--steps", "6", "--eval-interval", "3", "--precision", "fp32", *QUICK, *GLOO]
    assert main(list(map(str, common + ["--grad-accum", "2", "--out", tmp_path / "one"]))) == 0
    _torchrun(2, *common, "--grad-accum", "2", "--tp", "2", "--sequence-parallel", "--out", tmp_path / "tp")
    _torchrun(2, *common, "--out", tmp_path / "dp", "--stop-at", "3")
    _torchrun(2, *common, "--out", tmp_path / "dp", "--resume")
    one = _losses(tmp_path / "one")
    for run in ("tp", "dp"):
        other = _losses(tmp_path / run)
        assert [s for s, _, _ in other] == [s for s, _, _ in one]
        np.testing.assert_allclose([l for _, l, _ in other], [l for _, l, _ in one], rtol=1e-4)
        np.testing.assert_allclose([v for _, _, v in other if v], [v for _, _, v in one if v], rtol=1e-4)
    assert (tmp_path / "dp" / "checkpoint" / "latest").read_text().strip() == "step_6"


def _torchrun_failing(nproc, *args):
    """Like :func:`_torchrun` for a launch that must fail: (returncode, stderr)."""
    rc, _, stderr = run_torchrun(nproc, *args, timeout=300)
    return rc, stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2", "--sequence-parallel"], ["--tp", "1"]], ids=["tp2-sp", "dp2"])
def test_parallel_resume_is_exact(tmp_path, text_file, layout):
    """2 gloo processes, FP8 with dropout: stopped at step 3 and resumed from the torch.distributed.checkpoint
    to 6 == an uninterrupted run, loss for loss (exact float equality: parameters, AdamW state, each rank's FP8
    amax histories and RNG states all come back). The checkpoint keeps one copy of each tp shard's parameters,
    and per-rank buffers and RNG states."""
    from torch.distributed.checkpoint import FileSystemReader

    common = ["--data", text_file, "--steps", "6", "--eval-interval", "3", "--dropout", "0.1", "--precision", "fp8",
              *QUICK, *layout, *GLOO]
    _torchrun(2, *common, "--out", tmp_path / "full")
    _torchrun(2, *common, "--out", tmp_path / "split", "--stop-at", "3")
    keys = FileSystemReader(tmp_path / "split" / "checkpoint" / "step_3").read_metadata().state_dict_metadata
    tp_ranks = range(int(layout[1]))
    assert {k.split("/")[0] for k in keys if "/model." in k} == {f"tp{t}" for t in tp_ranks}
    assert {k.split("/")[0] for k in keys if "/optimizer.state." in k} == {f"tp{t}" for t in tp_ranks}
    assert {k.split("/")[0] for k in keys if k.endswith("amax_history")} == {"rank0", "rank1"}
    assert {"rank0/rng.torch", "rank1/rng.torch", "step", "settings.tp"} <= keys.keys()
    _torchrun(2, *common, "--out", tmp_path / "split", "--resume")
    full, split = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert [s for s, _, _ in full] == list(range(1, 7))
    assert split == full  # exact float equality
    # --keep-checkpoints 2 (default): the stop's step 3 and the end's step 6
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoint").iterdir()) == ["latest", "step_3", "step_6"]


@pytest.mark.slow
def test_parallel_resume_refuses_another_layout(tmp_path, text_file, capsys):
    """A checkpoint of 2 processes with --tp 2 resumed with another --tp or world size exits 2 with one line
    naming the launch to use, and leaves the checkpoint as it was."""
    common = ["--data", text_file, "--steps", "4", "--precision", "fp32", *QUICK, *GLOO, "--out", tmp_path]
    _torchrun(2, *common, "--tp", "2", "--stop-at", "2")
    latest = (tmp_path / "checkpoint" / "latest").read_text()
    rc, stderr = _torchrun_failing(2, *common, "--tp", "1", "--resume")
    assert rc != 0
    lines = [line for line in stderr.splitlines() if line.startswith("fp8engine.train: error:")]
    assert len(lines) == 1 and "torchrun --nproc-per-node 2 ... --tp 2" in lines[0], stderr[-3000:]
    assert "(exitcode: 2)" in stderr  # the workers' usage-error status (torchrun itself reports a failure)
    capsys.readouterr()
    assert main(list(map(str, common + ["--resume"]))) == 2  # one process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written by 2 processes with --tp 2, this run has 1" in err
    assert (tmp_path / "checkpoint" / "latest").read_text() == latest
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["latest", "step_1", "step_2"]
