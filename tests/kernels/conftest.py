"""Kernel tests: run the Triton kernels under the interpreter on CPU (TRITON_INTERPRET=1) when there is no GPU.

``triton.jit`` decides between compiled and interpreted kernels when a kernel module is imported, so the variable is
set here, before any test module imports fp8engine.kernels.*. With a GPU present it is left alone (unless the caller
set it), so the "cuda" cases run the compiled kernels and the "cpu" cases are skipped.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # the interpreter evaluates masked-off lanes too (numpy overflow / divide-by-zero warnings on garbage lanes)
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
