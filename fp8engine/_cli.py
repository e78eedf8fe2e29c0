"""The conventions every fp8engine command follows (``python -m fp8engine.train``, ``python -m fp8engine.bench`` and
its subcommands):

- ``--help`` prints what is there and exits 0;
- ``--version`` prints ``fp8engine <version>`` and exits 0;
- a usage error prints one line, ``<prog>: error: <what to change> (see --help)``, to stderr and exits 2.

argparse's own ``error`` prints the whole usage block before the message, which for the training command is a
dozen lines; :class:`CommandParser` keeps argparse's parsing and messages and prints only the message line.
Imports nothing beyond the standard library, so ``--help`` and ``--version`` answer without loading torch.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from fp8engine import __version__

__all__ = ["CommandParser", "USAGE_ERROR", "usage_error", "version_line"]

#: Exit status of a usage error (argparse's, and the shell's convention for misuse).
USAGE_ERROR = 2


def version_line() -> str:
    """What ``--version`` prints: ``fp8engine 0.1.0``."""
    return f"fp8engine {__version__}"


def usage_error(prog: str, message: str) -> NoReturn:
    """Print ``<prog>: error: <message> (see --help)`` on one line to stderr and exit with status 2."""
    message = " ".join(str(message).split())  # one line whatever the message holds
    print(f"{prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``--version`` added and one-line usage errors (exit 2).

    Same constructor arguments as ``argparse.ArgumentParser``; ``prog`` should be the command as typed
    (``python -m fp8engine.bench layer``), since it starts the error line.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keep the docstring's paragraphs
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=version_line(), help="print the version and exit")

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message)
