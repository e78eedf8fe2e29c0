"""Shared test helpers: devices to run on and the SQNR metric."""
import os

import pytest
import torch

from fp8engine._cpu import prefer_avx2_cpu_kernels

# Triton decides between compiled and interpreted kernels when a kernel module is imported, so without a GPU the
# interpreter is switched on here, before any test imports fp8engine.kernels.*.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# JAX would otherwise reserve 75 % of the GPU's memory when its tests import it, starving the torch tests that run
# after them in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The JAX frontend's tests assert exact scale rules and float64-referenced results that hold on XLA's CPU backend;
# XLA's GPU backend rewrites divisions and float32 matmuls (approximate reciprocal, TF32), so on a GPU machine
# the JAX tests still run on the CPU backend. (Set JAX_PLATFORMS yourself to try another backend.)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# torch's AVX-512 CPU kernels run the emulated FP8 GEMM ~100x slower than its AVX2 ones (fp8engine/_cpu.py); set
# before the first CPU kernel so the in-process tests and the subprocesses they start use the AVX2 kernels.
prefer_avx2_cpu_kernels()
# One Inductor cache per pytest-xdist worker, so that workers compiling the same graphs at once never share files:
# two workers compiling CPU graphs at once aborted ("Fatal Python error: Aborted"; 6 workers on the 16-core GPU
# machine, torch 2.11), while the same tests passed one process at a time.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['PYTEST_XDIST_WORKER']}"))

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """40 kB of varied text (drawn from the standard-library corpus) for the training command's ``--data``."""
    from fp8engine.training.data import stdlib_corpus

    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(stdlib_corpus(max_bytes=40_000)[0])
    return path


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20*log10(||ref|| / ||ref - actual||) (torchao's metric)."""
    ref, actual = ref.detach().double(), actual.detach().double()
    noise = (ref - actual).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def pytest_runtest_logreport(report):
    """With ``FP8ENGINE_TEST_DURATIONS=FILE``, append ``<seconds> <outcome> <test id>`` per test phase that took
    time, as each test finishes (also under pytest-xdist: the controller gets every report). A run cut at a device
    call's time limit still says which tests were slow and which failed (``--durations`` prints only at the end);
    tools/gpu_check.sh sets it and balances its shards by these times."""
    path = os.environ.get("FP8ENGINE_TEST_DURATIONS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and (report.when == "call" or report.outcome != "passed" or report.duration > 1.0):
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.when}:{report.outcome} {report.nodeid}\n")
