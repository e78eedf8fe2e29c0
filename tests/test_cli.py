"""Command-line conventions of every entry point (``fp8engine._cli``): ``--help`` exits 0 and lists what is there,
``--version`` prints ``fp8engine <version>``, a usage error prints one line on stderr and exits 2.

The dispatcher and a few training-command cases run as real commands (fresh interpreters, started together); the
rest call ``main`` in process (every command parses its arguments before touching a GPU or the data).
"""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fp8engine
from fp8engine.bench.__main__ import ALL, BENCHMARKS

REPO = Path(__file__).resolve().parents[1]
VERSION = f"fp8engine {fp8engine.__version__}"

COMMANDS = {
    "bench --help": ["fp8engine.bench", "--help"],
    "bench -h": ["fp8engine.bench", "-h"],
    "bench --version": ["fp8engine.bench", "--version"],
    "bench no name": ["fp8engine.bench"],
    "bench unknown name": ["fp8engine.bench", "nosuchbench"],
    "bench layer bad value": ["fp8engine.bench", "layer", "--rounds", "x"],
    "train --version": ["fp8engine.train", "--version"],
    "train unknown option": ["fp8engine.train", "--no-such-option"],
}


@pytest.fixture(scope="module")
def runs():
    """Start every command at once, then collect ``name -> (returncode, stdout, stderr)``."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {name: subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, argv in COMMANDS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def _assert_one_line_error(rc, stdout, stderr, prog, *phrases):
    assert rc == 2, (stdout, stderr)
    assert stdout == "" and "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{prog}: error: ") and lines[0].endswith("(see --help)")
    for phrase in phrases:
        assert phrase in lines[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_every_benchmark(runs, flag):
    rc, stdout, stderr = runs[f"bench {flag}"]
    assert rc == 0 and stderr == ""
    listed = {line.split()[0] for line in stdout.split("benchmarks:")[1].split("options:")[0].strip().splitlines()}
    assert listed == set(BENCHMARKS) | {"all"}


def test_bench_version(runs):
    assert runs["bench --version"] == (0, VERSION + "\n", "")


@pytest.mark.parametrize("case, phrase", [("bench no name", "name a benchmark"),
                                          ("bench unknown name", "'nosuchbench'")])
def test_bench_bad_name_is_one_line_exit_2(runs, case, phrase):
    _assert_one_line_error(*runs[case], "python -m fp8engine.bench", phrase, *BENCHMARKS)


def test_bench_subcommand_error_through_the_dispatcher(runs):
    _assert_one_line_error(*runs["bench layer bad value"], "python -m fp8engine.bench layer", "--rounds", "'x'")


def test_train_version(runs):
    assert runs["train --version"] == (0, VERSION + "\n", "")


def test_train_unknown_option_is_one_line_exit_2(runs):
    _assert_one_line_error(*runs["train unknown option"], "python -m fp8engine.train", "--no-such-option")


def test_train_help_and_bad_choice_in_process(capsys):
    from fp8engine import train

    with pytest.raises(SystemExit) as stop:
        train.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fp8engine.train") and "--precision" in out and "--version" in out
    with pytest.raises(SystemExit) as stop:
        train.main(["--precision", "fp4"])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    _assert_one_line_error(2, captured.out, captured.err, "python -m fp8engine.train", "'fp4'", "fp8")


def test_train_help_shows_real_defaults(capsys):
    """--help gives each flag's real default: per model where it depends on --model, none for on/off switches
    (argparse would print "(default: None)" / "(default: True)" for them)."""
    from fp8engine import train
    from fp8engine.models import GPT_CONFIGS
    from fp8engine.training.flags import MODEL_DEFAULTS

    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: False)" not in text
    parser = train.build_parser()
    options = {action.option_strings[-1][2:]: " ".join(parser._get_formatter()._format_action(action).split())
               for action in parser._actions}  # each flag's entry in that text
    steps = ", ".join(f"{name} {s}" for name, (s, _, _) in MODEL_DEFAULTS.items())
    assert f"(default per model: {steps})" in options["steps"]
    batch = ", ".join(f"{name} {b}" for name, (_, b, _) in MODEL_DEFAULTS.items())
    assert f"(default per model: {batch})" in options["batch-size"]
    assert "tiny 0.003," in options["lr"]
    context = ", ".join(f"{name} {c.max_seq_len}" for name, c in GPT_CONFIGS.items())
    assert context in options["seq-len"]
    assert "(default" not in options["no-cuda-graphs"] and "(default" not in options["compile"]
    assert "(default: fp8)" in options["precision"] and "(default: 1337)" in options["seed"]


def test_flush_denormals_keeps_the_users_setting(monkeypatch):
    """fp8engine._cpu.flush_denormals: on by default inside the block and undone after it; FP8ENGINE_FLUSH_DENORMAL=0
    (false, off, no) leaves the setting alone; a process that already flushes keeps flushing after the block."""
    import torch

    from fp8engine._cpu import FLUSH_DENORMAL_ENV, denormals_flushed, flush_denormals

    assert not denormals_flushed()  # torch's default
    monkeypatch.delenv(FLUSH_DENORMAL_ENV, raising=False)
    with flush_denormals() as flushed:
        assert flushed and denormals_flushed()
        assert torch.tensor(1e-39).mul(1.0).item() == 0.0  # a denormal float32 reads as 0
    assert not denormals_flushed() and torch.tensor(1e-39).mul(1.0).item() != 0.0
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(FLUSH_DENORMAL_ENV, off)
        with flush_denormals() as flushed:
            assert not flushed and not denormals_flushed()
    torch.set_flush_denormal(True)  # the user's own setting
    try:
        for value in ("1", "0"):
            monkeypatch.setenv(FLUSH_DENORMAL_ENV, value)
            with flush_denormals() as flushed:
                assert flushed
            assert denormals_flushed()
    finally:
        torch.set_flush_denormal(False)


def _bench_module(name):
    if name == "jax":
        pytest.importorskip("jax")
        pytest.importorskip("flax")
    return importlib.import_module(BENCHMARKS[name][0])


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_subcommand_help_and_version(name, capsys):
    module = _bench_module(name)
    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as stop:
            module.main([flag])
        assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m fp8engine.bench {name}") and out.endswith(VERSION + "\n")


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_subcommand_unknown_option_is_one_line_exit_2(name, capsys):
    module = _bench_module(name)
    with pytest.raises(SystemExit) as stop:
        module.main(["--no-such-option"])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    _assert_one_line_error(2, captured.out, captured.err, f"python -m fp8engine.bench {name}", "--no-such-option")


def test_bench_train_bad_model_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        _bench_module("train").main(["--models", "gpt5", "--device", "cpu"])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    _assert_one_line_error(2, captured.out, captured.err, "python -m fp8engine.bench train", "gpt5")


def test_all_runs_registered_benchmarks():
    assert set(ALL) <= set(BENCHMARKS)
