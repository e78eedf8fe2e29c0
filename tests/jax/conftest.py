"""Helpers for the JAX frontend tests (skipped cleanly when jax/flax are not installed)."""
import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")


def sqnr_db(ref, actual) -> float:
    """Signal-to-quantization-noise ratio in dB, 20*log10(||ref|| / ||ref - actual||), computed in float64."""
    ref = np.asarray(ref, np.float64)
    noise = np.linalg.norm(ref - np.asarray(actual, np.float64))
    return float("inf") if noise == 0 else float(20 * np.log10(np.linalg.norm(ref) / noise))


@pytest.fixture
def sqnr():
    return sqnr_db
