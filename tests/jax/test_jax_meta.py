"""The delayed-scaling rule of the JAX frontend: exact (rtol=0, atol=0), and bit-identical to the torch side."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402
from flax.core.frozen_dict import FrozenDict  # noqa: E402

import fp8engine.jax as fj  # noqa: E402
from fp8engine.recipe import FP8_MAX, DelayedScaling  # noqa: E402

L = 7


def _histories(seed: int) -> np.ndarray:
    """[12, L] float32 histories: random magnitudes over 8 decades plus the edge cases of the rule."""
    rng = np.random.default_rng(seed)
    h = (10.0 ** rng.uniform(-4, 4, size=(12, L))).astype(np.float32)
    h[0] = 0.0  # all zero -> keep previous scale
    h[1, 0] = np.inf  # non-finite amax
    h[2, 3] = np.nan
    h[3] = 1e-40  # denormal amax: fp8_max / amax overflows -> keep previous scale
    h[4, 0] = 0.0  # zero most recent, non-zero older
    return h


def _reference(h, scale, fp8_max, margin, algo):
    """The rule in numpy float32: sf = (fp8_max / amax) / 2**margin, previous scale kept where unusable."""
    amax = h.max(axis=-1) if algo == "max" else h[:, 0]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        sf = (np.float32(fp8_max) / amax) / np.float32(2.0**margin)
    usable = (amax > 0) & np.isfinite(amax) & np.isfinite(sf)
    sf = np.where(usable, sf, scale).astype(np.float32)
    return sf, (np.float32(1.0) / sf).astype(np.float32)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fp8_max", [FP8_MAX["e4m3"], FP8_MAX["e5m2"]])
def test_compute_scale_exact(algo, margin, fp8_max):
    h = _histories(margin)
    scale = np.linspace(0.5, 4.0, h.shape[0]).astype(np.float32)
    s, s_inv = fj.compute_scale(jnp.asarray(h), jnp.asarray(scale), fp8_max, margin=margin, amax_compute_algo=algo)
    ref_s, ref_inv = _reference(h, scale, fp8_max, margin, algo)
    np.testing.assert_array_equal(np.asarray(s), ref_s)  # exact
    np.testing.assert_array_equal(np.asarray(s_inv), ref_inv)
    assert np.asarray(s)[0] == scale[0] and np.asarray(s)[3] == scale[3]  # kept where amax is unusable


def test_roll_amax_history_exact():
    h = jnp.asarray([[5.0, 1.0, 2.0, 3.0], [9.0, 8.0, 7.0, 6.0]], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(fj.roll_amax_history(h)), np.array([[0.0, 2.0, 3.0, 5.0], [0.0, 7.0, 6.0, 9.0]], np.float32)
    )


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_agrees_with_torch_bit_for_bit(algo, margin):
    torch = pytest.importorskip("torch")
    scaling = pytest.importorskip("fp8engine.fp8.scaling")
    h = _histories(10 + margin)
    scale = np.linspace(0.5, 4.0, h.shape[0]).astype(np.float32)
    for fp8_max in FP8_MAX.values():
        t_s, t_inv = scaling.update_fp8_scale(
            torch.from_numpy(h), torch.from_numpy(scale), fp8_max, margin=margin, amax_compute_algo=algo
        )
        j_s, j_inv = fj.compute_scale(
            jnp.asarray(h), jnp.asarray(scale), fp8_max, margin=margin, amax_compute_algo=algo
        )
        np.testing.assert_array_equal(np.asarray(j_s), t_s.numpy())  # same bits
        np.testing.assert_array_equal(np.asarray(j_inv), t_inv.numpy())
    t_roll = scaling.update_amax_history(torch.from_numpy(h.copy()))
    np.testing.assert_array_equal(np.asarray(fj.roll_amax_history(jnp.asarray(h))), t_roll.numpy())


def _meta(history, scale=1.0, fp8_max=448.0):
    s = jnp.asarray(scale, jnp.float32)
    return fj.Fp8Meta(jnp.asarray(fp8_max, jnp.float32), jnp.asarray(history, jnp.float32), s, 1.0 / s)


@pytest.mark.parametrize("container", [dict, FrozenDict])
@pytest.mark.parametrize("recipe", [DelayedScaling(), DelayedScaling(margin=1, amax_compute_algo="most_recent")])
def test_update_fp8_metas_applies_active_recipe(container, recipe):
    metas = container(
        {
            "layer": {"input_meta": _meta([2.0, 8.0, 1.0]), "grad_meta": _meta([0.5, 0.25, 4.0], 3.0, 57344.0)},
            "other": jnp.arange(3.0),
        }
    )
    with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
        new = fj.update_fp8_metas(metas)
    assert type(new) is container
    np.testing.assert_array_equal(np.asarray(new["other"]), np.arange(3.0))  # non-meta leaves untouched
    for name, old in metas["layer"].items():
        got = new["layer"][name]
        s, s_inv = fj.compute_scale(
            old.amax_history, old.scale, old.fp8_max, margin=recipe.margin, amax_compute_algo=recipe.amax_compute_algo
        )
        assert float(got.scale) == float(s) and float(got.scale_inv) == float(s_inv)
        np.testing.assert_array_equal(np.asarray(got.amax_history), np.asarray(fj.roll_amax_history(old.amax_history)))
    expect = 448.0 / (8.0 if recipe.amax_compute_algo == "max" else 2.0) / 2**recipe.margin
    assert float(new["layer"]["input_meta"].scale) == expect


def test_update_fp8_metas_interval():
    metas = {"m": _meta([4.0, 1.0, 0.0], scale=2.0)}
    with fj.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(interval=2)):
        with pytest.raises(ValueError, match="step"):
            fj.update_fp8_metas(metas)
        skipped = fj.update_fp8_metas(metas, step=1)
        updated = jax.jit(lambda m, s: fj.update_fp8_metas(m, step=s))(metas, 4)
    assert float(skipped["m"].scale) == 2.0  # not an update step: scale kept ...
    np.testing.assert_array_equal(np.asarray(skipped["m"].amax_history), [0.0, 0.0, 4.0])  # ... history rolled
    assert float(updated["m"].scale) == 448.0 / 4.0


def test_update_fp8_metas_accepts_max_grad_dtype():
    metas = fj.to_max_grad({"m": _meta([4.0, 1.0, 0.0])})
    assert metas["m"].scale.dtype == fj.MAX_GRAD_F32
    new = jax.jit(fj.update_fp8_metas)(metas)
    assert new["m"].scale.dtype == jnp.float32 and float(new["m"].scale) == 112.0


def test_update_collections_keeps_container_type():
    orig = {"params": {"w": 1}, fj.FP8_COLLECTION: {"a": 1}}
    merged = fj.update_collections({fj.FP8_COLLECTION: {"a": 2}}, orig)
    assert type(merged) is dict and merged == {"params": {"w": 1}, fj.FP8_COLLECTION: {"a": 2}}
    frozen = fj.update_collections({fj.FP8_COLLECTION: {"a": 2}}, FrozenDict(orig))
    assert isinstance(frozen, FrozenDict) and frozen[fj.FP8_COLLECTION]["a"] == 2 and frozen["params"]["w"] == 1
    assert orig[fj.FP8_COLLECTION] == {"a": 1}  # the original is not modified
    with pytest.raises(TypeError, match="dict or FrozenDict"):
        fj.update_collections([("a", 1)], orig)
