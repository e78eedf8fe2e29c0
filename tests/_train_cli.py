"""Running the training command from tests: in a fresh interpreter, and as ``torchrun`` processes (gloo ranks on
the CPU). Shared by the training-command test files; the corpus fixture ``text_file`` is in ``tests/conftest.py``."""
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_env(one_thread: bool = False) -> dict:
    """This environment with the repository on ``PYTHONPATH`` (and ``OMP_NUM_THREADS=1`` with ``one_thread``:
    several processes sharing the 2 CI cores)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous whose launcher cannot take port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_train(*args, cwd=None, one_thread: bool = False, timeout: int = 600) -> tuple[int, str, str]:
    """``python -m fp8engine.train ARGS`` in a fresh interpreter: ``(returncode, stdout, stderr)``."""
    proc = subprocess.run([sys.executable, "-m", "fp8engine.train", *map(str, args)], cwd=cwd or REPO,
                          env=train_env(one_thread), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def run_torchrun(nproc: int, *args, timeout: int = 600) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc-per-node NPROC -m fp8engine.train ARGS``, one thread per process:
    ``(returncode, stdout, stderr)``. ``--standalone``: the launcher binds its rendezvous to a port of its own
    choosing (a port picked here and bound later can be taken meanwhile by another test's launch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fp8engine.train", *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(one_thread=True), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr
