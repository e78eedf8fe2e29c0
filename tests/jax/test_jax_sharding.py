"""Sharded vs unsharded FP8 steps on a 2x2 (data, model) mesh of 4 CPU devices.

The mesh needs ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax is imported, so the sharded
runs happen in a subprocess (``_sharded_run.py``) that saves its arrays; the comparisons are made here.
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "out.npz"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "_sharded_run.py"), str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(path) as data:
        return dict(data)


def _pairs(results, prefix, other):
    keys = [k for k in results if k.startswith(prefix)]
    assert keys
    return [(k[len(prefix) :], results[k], results[other + k[len(prefix) :]]) for k in keys]


@pytest.mark.parametrize("ref, sharded", [("ref_mlp", "gspmd_mlp"), ("ref_dense", "smap_dense")])
def test_sharded_step_equals_unsharded(results, ref, sharded):
    n_meta = 0
    for key, want, got in _pairs(results, ref, sharded):
        assert want.shape == got.shape, key
        if "_meta" in key:  # an Fp8Meta field of the updated metas
            n_meta += 1
            if "fc1" in key and "grad_meta" in key:
                # fc1's output gradient comes out of fc2's dgrad GEMM, whose sharded reduction order differs
                # by an ulp; its amax (hence scale) inherits that ulp.
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=key)
            else:
                np.testing.assert_array_equal(got, want, err_msg=key)  # max of identical tensors: exact
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=key)  # GEMM reduction order
    assert n_meta == (2 if ref == "ref_mlp" else 1) * 3 * 4  # GEMMs x metas x fields


def test_kernel_is_annotated_for_the_tp_axis(results):
    from jax.sharding import PartitionSpec

    assert str(results["gspmd_fc1_kernel_spec"]) == str(PartitionSpec(None, "model"))


def test_without_pmax_the_amax_is_per_shard(results):
    """Control: the same shard_map without a MeshResource keeps per-shard amaxes, which differ."""
    key = next(k for k in results if k.startswith("ref_dense") and "input_meta" in k and "amax_history" in k)
    control = results["control_dense" + key[len("ref_dense") :]]
    # After the update's roll, this step's amax sits in the last slot: device 0 only saw the small data shard.
    assert control[-1] < results[key][-1]
