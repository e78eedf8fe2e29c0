"""``python -m fp8engine.bench NAME [options]``: run one benchmark; it prints a Markdown table and, with
``--json PATH``, writes its rows with the GPU, versions and date. ``python -m fp8engine.bench NAME --help`` lists
the benchmark's options; ``docs/benchmarks.md`` holds the current figures and the command that produced each.

Each benchmark lives in its own module exposing ``main(argv: list[str]) -> int``; adding one is one line in
:data:`BENCHMARKS`. Modules are imported only when their benchmark runs, so ``--help`` does not load torch.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

from fp8engine._cli import usage_error, version_line
from fp8engine._cpu import flush_denormals, prefer_avx2_cpu_kernels

PROG = "python -m fp8engine.bench"

#: name -> (module with ``main(argv) -> int``, what it measures: one line for ``--help``).
BENCHMARKS = {
    "cast": ("fp8engine.bench.cast", "bf16 -> FP8 cast and cast-transpose bandwidth vs a device copy and torch"),
    "linear": ("fp8engine.bench.linear", "fp8engine.Linear fwd+bwd vs nn.Linear bf16 and torchao.float8"),
    "layer": ("fp8engine.bench.layer", "TransformerLayer fwd+bwd vs the plain bf16 block and torchao.float8; "
                                       "--tp T under torchrun"),
    "train": ("fp8engine.bench.train", "training-command steps: ms/step, tokens/s, MFU per precision and mode"),
    "jax": ("fp8engine.bench.jax_dense", "fp8engine.jax DenseGeneral vs flax bf16 and flax fp8_ops"),
    "comm": ("fp8engine.bench.comm", "sequence-parallel all-gather, bf16 vs FP8 (under torchrun)"),
    "lm_loss": ("fp8engine.bench.lm_loss", "LM head + cross-entropy fwd+bwd per backend (unfused, chunked, liger, "
                                           "cce)"),
}
#: What ``all`` runs, in order: the single-GPU benchmarks of the FP8 building blocks.
ALL = ("cast", "linear", "layer")


def help_text() -> str:
    """The text of ``python -m fp8engine.bench --help``."""
    width = max(map(len, BENCHMARKS))
    lines = [f"usage: {PROG} {{{','.join([*BENCHMARKS, 'all'])}}} [options]", "",
             "Run one benchmark: it prints a Markdown table and, with --json PATH, writes its rows with the GPU,",
             "versions and date. NAME --help lists a benchmark's options; docs/benchmarks.md holds the current",
             "figures and the command behind each.", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    lines += [f"  {'all':<{width}}  {', '.join(ALL)} in turn, with the same options", "",
              "options:", "  -h, --help  show this message and exit", "  --version   print the version and exit"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Dispatch to the benchmark named by ``argv[0]``; returns the exit status (2 for a usage error)."""
    prefer_avx2_cpu_kernels()  # before the first CPU kernel (fp8engine/_cpu.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        usage_error(PROG, f"name a benchmark: {', '.join([*BENCHMARKS, 'all'])}")
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        print(help_text())
        return 0
    if name == "--version":
        print(version_line())
        return 0
    if name != "all" and name not in BENCHMARKS:
        usage_error(PROG, f"unknown benchmark {name!r}; choose from {', '.join([*BENCHMARKS, 'all'])}")
    status = 0
    with flush_denormals():  # CPU denormals read as 0 (FP8ENGINE_FLUSH_DENORMAL=0: kept; fp8engine/_cpu.py)
        for bench in ALL if name == "all" else (name,):
            status = max(status, importlib.import_module(BENCHMARKS[bench][0]).main(rest))
    return status


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: no interpreter teardown (fp8engine.train.command)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
