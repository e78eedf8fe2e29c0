"""Machinery of the training command (``fp8engine.train``): data, checkpoints, metrics.

Every helper reports bad user input by raising :class:`UsageError` with one line that says what to change; the
command prints it and exits with status 2.
"""


class UsageError(Exception):
    """Bad command-line input or environment; the message is one line telling the user what to change."""


__all__ = ["UsageError"]
