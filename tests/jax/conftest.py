"""Helpers for the JAX frontend tests (skipped cleanly when jax/flax are not installed)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

# The tests compare high-precision results with float64 references at ~1e-5; on a GPU, XLA's default float32
# matmul precision is TF32 (10-bit mantissa, errors ~1e-3), so ask for full float32 there as on the CPU.
jax.config.update("jax_default_matmul_precision", "highest")


def sqnr_db(ref, actual) -> float:
    """Signal-to-quantization-noise ratio in dB, 20*log10(||ref|| / ||ref - actual||), computed in float64."""
    ref = np.asarray(ref, np.float64)
    noise = np.linalg.norm(ref - np.asarray(actual, np.float64))
    return float("inf") if noise == 0 else float(20 * np.log10(np.linalg.norm(ref) / noise))


@pytest.fixture
def sqnr():
    return sqnr_db
