"""The README tells one story, and it is true: every ```python block of it runs on a CPU as written, its two commands
are the ones ``.ci/run`` runs, the training command's synopsis lists exactly the command's flags, every training and
benchmark command in README.md and docs/benchmarks.md parses with today's parsers, and the files they point to
exist.

The Python blocks run in this process, each in a fresh namespace (each block is a complete program a reader can
paste), in order; they are sized to take seconds on the 2-core CI machine. Commands are parsed, not run.
"""
import argparse
import importlib
import itertools
import re
import subprocess
import shlex
from pathlib import Path

import pytest

from fp8engine import _cli
from fp8engine.bench.__main__ import BENCHMARKS
from fp8engine.bench.train import BATCH, MODES
from fp8engine.training.flags import build_parser, check_flags

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = (REPO / "docs" / "benchmarks.md").read_text()

#: The README's two required commands: set up and run the main job; set up and run the tests (what .ci/run runs).
RUN_COMMAND = "pip install torch==2.13.0 && pip install -e . && python -m fp8engine.train"
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test,jax]" && python -m pytest -q'


def _fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang fenced blocks of ``text`` (``lang=""``: blocks without a language)."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)


PYTHON_BLOCKS = _fenced(README, "python")


def test_readme_has_its_python_examples():
    assert len(PYTHON_BLOCKS) >= 3  # the Linear, the FP8 health report and the GPT examples


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_on_cpu(index):
    """As written, with no names from other blocks (a block that needs a GPU would fail on the CPU CI machine)."""
    code = compile(PYTHON_BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": "__readme__"})


def test_readme_commands_are_the_ones_ci_runs():
    bash = [block.strip() for block in _fenced(README, "bash")]
    assert RUN_COMMAND in bash and TEST_COMMAND in bash
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci  # .ci/run runs the README's test command, as it is written there


def test_training_synopsis_lists_exactly_the_commands_flags():
    synopsis = [b for b in _fenced(README, "") if b.startswith("python -m fp8engine.train [")]
    assert len(synopsis) == 1
    listed = set(re.findall(r"--[a-z0-9-]+", synopsis[0]))
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert listed == flags - {"--help", "--version"}


# ----------------------------------------------------------------------------------------- commands in the docs

#: Placeholders the docs write for values: replaced by a value of the right kind before parsing.
_PLACEHOLDERS = {"T": "2", "N": "2", "K": "2"}


def _expand(command: str) -> list[str]:
    """Every command a ``{a,b}`` / ``{a | b}`` alternative in ``command`` stands for."""
    parts = re.split(r"\{([^{}]*)\}", command)
    choices = [[p] if i % 2 == 0 else [c.strip() for c in re.split(r"[|,]", p)] for i, p in enumerate(parts)]
    return [" ".join("".join(pick).split()) for pick in itertools.product(*choices)]


def _commands(module: str) -> list[tuple[str, str]]:
    """``(file, arguments)`` of every ``-m fp8engine.<module>`` command in an inline code span of README.md or
    docs/benchmarks.md (spans may wrap lines; fenced blocks are checked by the tests above; synopses such as
    ``python -m fp8engine.bench NAME [--json PATH]`` are not commands)."""
    found = []
    for name, text in (("README.md", README), ("docs/benchmarks.md", DOCS)):
        for span in re.findall(r"`([^`]+)`", _without_fences(text)):
            span = " ".join(span.split())
            match = re.search(rf"-m fp8engine\.{module}\b(.*)", span)
            if match and "[" not in span and " NAME" not in span:
                found += [(name, args) for args in _expand(match.group(1).split("&&")[0])]
    return found


def _argv(args: str) -> list[str]:
    return [_PLACEHOLDERS.get(a, a) for a in shlex.split(args)]


TRAIN_COMMANDS = _commands("train")
BENCH_COMMANDS = _commands("bench")


def test_the_docs_name_commands():
    assert len(TRAIN_COMMANDS) >= 5 and len(BENCH_COMMANDS) >= 5  # the extraction finds them


@pytest.mark.parametrize("where, args", TRAIN_COMMANDS)
def test_docs_training_command_parses(where, args, capsys):
    try:
        check_flags(build_parser().parse_args(_argv(args)))
    except SystemExit:
        pytest.fail(f"{where}: `python -m fp8engine.train {args}` does not parse: {capsys.readouterr().err}")


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments parsed."""


@pytest.mark.parametrize("where, args", BENCH_COMMANDS)
def test_docs_bench_command_parses(where, args, monkeypatch, capsys):
    argv = _argv(args)
    if not argv or argv[0] in ("-h", "--help", "all"):
        return
    assert argv[0] in BENCHMARKS, f"{where}: no benchmark {argv[0]!r}"
    if argv[0] == "jax":
        pytest.importorskip("flax")
    original = _cli.CommandParser.parse_args

    def parse_then_stop(self, *a, **k):
        raise _Parsed(original(self, *a, **k))

    monkeypatch.setattr(_cli.CommandParser, "parse_args", parse_then_stop)
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    with pytest.raises(_Parsed) as parsed:
        try:
            module.main(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: `python -m fp8engine.bench {args}` does not parse: {capsys.readouterr().err}")
    if argv[0] == "train":
        ns: argparse.Namespace = parsed.value.args[0]
        assert set(ns.modes.split(",")) <= set(MODES), f"{where}: unknown mode in `{args}`"
        assert set(ns.models.split(",")) <= set(BATCH), f"{where}: unknown model in `{args}`"


# -------------------------------------------------------------------------------------------------- pointers

def _paths(text: str) -> set[str]:
    """Repository paths named in ``text``: code spans and link targets under tools/, fp8engine/, tests/, examples/,
    docs/, kernels/ (short for fp8engine/kernels/) or img/ (beside docs/benchmarks.md)."""
    candidates = re.findall(r"`([^`\s]+)`", text) + re.findall(r"\]\(([^)#\s]+)", text)
    candidates += re.findall(r"\b(?:python |torchrun \S+ \S+ )(tools/\S+\.py)(?!@)", text)  # (@rev: below)
    return {c for c in candidates
            if re.match(r"(tools|fp8engine|tests|examples|docs|kernels|img)/[\w./-]*\w$", c)}


@pytest.mark.parametrize("name", ["README.md", "docs/benchmarks.md"])
def test_named_files_exist(name):
    """Every file README.md and docs/benchmarks.md point to exists (relative to the repository, the document or
    ``fp8engine/``): no pointer to a tool or module that was renamed or removed."""
    text, base = (REPO / name).read_text(), (REPO / name).parent
    paths = _paths(text)
    assert paths  # the extraction finds them
    missing = [p for p in sorted(paths)
               if not any((root / p).exists() for root in (REPO, base, REPO / "fp8engine"))]
    assert not missing, f"{name} names files that do not exist: {missing}"
    # a removed tool is cited with the commit that has it (tools/README.md): it must be there
    # (checked where the checkout has that commit: a copy of the working tree without history cannot say)
    for path, rev in re.findall(r"\b(tools/[\w.-]+\.(?:py|sh))@([0-9a-f]{7,40})\b", text):
        git = lambda obj: subprocess.run(["git", "cat-file", "-e", obj], cwd=REPO, capture_output=True).returncode
        if git(f"{rev}^{{commit}}") == 0:
            assert git(f"{rev}:{path}") == 0, f"{name} cites {path}@{rev}, which that commit does not have"
