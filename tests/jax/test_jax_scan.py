"""Meta gradients combine by max (not sum) across micro-batches in nn.scan: the MAX_GRAD_F32 dtype."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import fp8engine.jax as fj  # noqa: E402
from fp8engine.recipe import DelayedScaling  # noqa: E402

RECIPE = DelayedScaling(amax_history_len=4)
OLD_HISTORY = np.array([0.0, 2.5, 1.0, 0.5], np.float32)  # past steps' amaxes, must survive unchanged


class _MicroBatched(nn.Module):
    """The same DenseGeneral applied to each micro-batch in turn (pipeline-style gradient accumulation)."""

    @nn.compact
    def __call__(self, xs):
        def body(layer, carry, x):
            return carry + jnp.sum(layer(x) ** 2), None

        scan = nn.scan(
            body,
            variable_broadcast=["params", fj.FP8_COLLECTION],
            split_rngs={"params": False},
            length=xs.shape[0],
        )
        total, _ = scan(fj.DenseGeneral(8, name="dense"), jnp.zeros((), jnp.float32), xs)
        return total


def _setup():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 5, 16)).astype(np.float32)
    xs *= np.array([1.0, 7.0, 3.0], np.float32)[:, None, None]  # micro-batch 1 has the largest amax
    model = _MicroBatched()
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        variables = model.init(jax.random.PRNGKey(0), jnp.asarray(xs))
    metas = jax.tree_util.tree_map(
        lambda m: m.replace(amax_history=jnp.asarray(OLD_HISTORY)),
        variables[fj.FP8_COLLECTION],
        is_leaf=lambda m: isinstance(m, fj.Fp8Meta),
    )
    return model, variables["params"], metas, jnp.asarray(xs)


def _meta_grads(model, params, metas, xs, convert_outside_scan):
    def loss(metas):
        if convert_outside_scan:
            metas = fj.to_max_grad(metas)  # the documented way: before nn.scan
        return model.apply({"params": params, fj.FP8_COLLECTION: metas}, xs)

    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        return jax.jit(jax.grad(loss))(metas)


def test_meta_grads_combine_by_max_through_nn_scan():
    model, params, metas, xs = _setup()
    grads = _meta_grads(model, params, metas, xs, convert_outside_scan=True)["dense"]
    x_hist = np.asarray(grads["input_meta"].amax_history)
    assert grads["input_meta"].amax_history.dtype == jnp.float32
    assert x_hist[0] == np.abs(np.asarray(xs)).max()  # max over micro-batches, exactly
    assert x_hist[0] > np.abs(np.asarray(xs[0])).max()  # ... not the first (or last) micro-batch's
    np.testing.assert_array_equal(x_hist[1:], OLD_HISTORY[1:])  # past entries not summed 3 times
    for name in ("input_meta", "kernel_meta", "grad_meta"):
        meta, old = grads[name], metas["dense"][name]
        assert float(meta.scale) == float(old.scale) and float(meta.fp8_max) == float(old.fp8_max)
        np.testing.assert_array_equal(np.asarray(meta.amax_history)[1:], OLD_HISTORY[1:])
    # The grad amax is the largest |dy| = |2 y| over the micro-batches.
    with fj.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        ys = [fj.DenseGeneral(8).apply({"params": params["dense"], fj.FP8_COLLECTION: metas["dense"]}, x) for x in xs]
    g_amax = max(float(jnp.max(jnp.abs(2 * y))) for y in ys)
    np.testing.assert_allclose(float(grads["grad_meta"].amax_history[0]), g_amax, rtol=1e-6)


def test_float32_metas_inside_scan_would_sum():
    """The control: without the max dtype outside the scan, the per-micro-batch cotangents are summed."""
    model, params, metas, xs = _setup()
    grads = _meta_grads(model, params, metas, xs, convert_outside_scan=False)["dense"]
    np.testing.assert_allclose(np.asarray(grads["input_meta"].amax_history)[1:], 3 * OLD_HISTORY[1:])
    assert float(grads["input_meta"].scale) == 3.0


def test_max_grad_dtype_rules():
    @jax.jit
    def cotangents(x, a, b):
        v = lax.convert_element_type(x, fj.MAX_GRAD_F32)
        to_m = lambda t: lax.convert_element_type(t, fj.MAX_GRAD_F32)  # noqa: E731
        _, pullback = jax.vjp(lambda u: [u, u], v)
        (ct,) = pullback([to_m(a), to_m(b)])  # two uses: cotangents added with the dtype's rule
        _, unused = jax.vjp(lambda u: jnp.float32(1.0), v)
        (zero,) = unused(jnp.float32(1.0))  # no use: the dtype's zero
        return fj.to_float32(ct), fj.to_float32(zero)

    x = jnp.asarray([1.0, -2.0, 3.0], jnp.float32)
    ct, zero = cotangents(x, jnp.asarray([5.0, -1.0, 0.0]), jnp.asarray([2.0, -3.0, 4.0]))
    np.testing.assert_array_equal(np.asarray(ct), [5.0, -1.0, 4.0])  # max, not sum
    assert np.all(np.isneginf(np.asarray(zero)))  # identity of max
    with pytest.raises((TypeError, ValueError)):
        lax.convert_element_type(jnp.ones(2, jnp.bfloat16), fj.MAX_GRAD_F32)  # only float32 converts
