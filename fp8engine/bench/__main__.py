"""``python -m fp8engine.bench {cast,linear,layer,jax,comm,all} [options]``: print a table and write JSON.

Each benchmark lives in its own module exposing ``main(argv: list[str]) -> int``.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "cast": "fp8engine.bench.cast",
    "linear": "fp8engine.bench.linear",
    "layer": "fp8engine.bench.layer",
    "jax": "fp8engine.bench.jax_dense",
    "comm": "fp8engine.bench.comm",
    "train": "fp8engine.bench.train",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = list(BENCHMARKS) + ["all"]
    if not argv or argv[0] not in names:
        print(f"usage: python -m fp8engine.bench {{{','.join(names)}}} [options]", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    selected = ["cast", "linear", "layer"] if name == "all" else [name]
    status = 0
    for bench in selected:
        status |= importlib.import_module(BENCHMARKS[bench]).main(rest)
    return status


if __name__ == "__main__":
    sys.exit(main())
