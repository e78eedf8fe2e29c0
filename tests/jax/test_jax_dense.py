"""FP8 DenseGeneral / LayerNormDenseGeneral / LayerNormMLP against float64 references.

Thresholds (torchao's, test/float8/test_base.py): >= 25 dB for an FP8 GEMM with E4M3 operands; >= 18 dB for
outputs and gradients that went through an E5M2 gradient cast (2 mantissa bits) or two FP8 layers.
"""
import re

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402

import fp8engine.jax as fj  # noqa: E402
from fp8engine.recipe import DelayedScaling, Format  # noqa: E402

from tests.jax.conftest import sqnr_db  # noqa: E402

RECIPES = [
    DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4),
]


def _grads(model, variables, x, dy):
    """(y, dparams, dx, dmetas) of sum(y * dy)."""

    def loss(params, metas, x):
        y = model.apply({"params": params, fj.FP8_COLLECTION: metas}, x)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y * dy), y

    (_, y), (dp, dm, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        variables["params"], variables[fj.FP8_COLLECTION], x
    )
    return y, dp, dx, dm


def _calibrated(model, recipe, x, dy):
    """Variables after one step (amaxes recorded) and one update_fp8_metas (scales set from them)."""
    with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
        variables = model.init(jax.random.PRNGKey(7), x)
        *_, dm = _grads(model, variables, x, dy)
        return {"params": variables["params"], fj.FP8_COLLECTION: fj.update_fp8_metas(dm)}


def _data(rows, k, n, seed=0, dy_scale=1e-3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3.0
    dy = rng.standard_normal((rows, n)).astype(np.float32) * dy_scale  # small grads: E5M2 needs a real scale
    return jnp.asarray(x), jnp.asarray(dy)


@pytest.mark.parametrize(
    "recipe, rows, k, n",
    [(RECIPES[0], 64, 96, 80), (RECIPES[0], 1151, 48, 40), (RECIPES[1], 1151, 48, 40)],
    ids=["hybrid-64", "hybrid-1151", "e4m3-1151"],
)
def test_dense_general_vs_float64(recipe, rows, k, n):
    model = fj.DenseGeneral(n, bias_init=jax.nn.initializers.normal(0.1))
    x, dy = _data(rows, k, n)
    variables = _calibrated(model, recipe, x, dy)
    with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y, dp, dx, dm = _grads(model, variables, x, dy)
    w = np.asarray(variables["params"]["kernel"], np.float64)
    b = np.asarray(variables["params"]["bias"], np.float64)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    assert sqnr_db(x64 @ w + b, y) >= 25  # fprop, E4M3 x and w
    grad_floor = 18 if recipe.fp8_format is Format.HYBRID else 25  # E5M2 dy under HYBRID, E4M3 otherwise
    assert sqnr_db(dy64 @ w.T, dx) >= grad_floor  # dgrad
    assert sqnr_db(x64.T @ dy64, dp["kernel"]) >= grad_floor  # wgrad
    np.testing.assert_allclose(np.asarray(dp["bias"]), dy64.sum(0), rtol=1e-5, atol=1e-6)  # bias stays exact-ish
    # The amaxes of this step come back in slot 0 of the histories, exactly.
    assert float(dm["input_meta"].amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert float(dm["kernel_meta"].amax_history[0]) == float(np.abs(w).max().astype(np.float32))
    assert float(dm["grad_meta"].amax_history[0]) == float(jnp.max(jnp.abs(dy)))


def _q(a, scale, dtype):
    """Reference quantize-dequantize in numpy (ml_dtypes casts round to nearest even)."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    q = np.clip(a.astype(np.float32) * np.float32(scale), -fmax, fmax).astype(dtype)
    return q.astype(np.float32) * np.float32(1.0 / np.float32(scale))


def test_dense_general_equals_emulation():
    """Forward and gradients equal a numpy emulation of the FP8 roundings with the metas' scales."""
    recipe = RECIPES[0]
    model = fj.DenseGeneral(24, use_bias=False)
    x, dy = _data(33, 40, 24, seed=3)
    variables = _calibrated(model, recipe, x, dy)
    metas = variables[fj.FP8_COLLECTION]
    scales = {name: float(metas[name].scale) for name in ("input_meta", "kernel_meta", "grad_meta")}
    assert all(s not in (0.0, 1.0) for s in scales.values())  # delayed scales were set by the update
    with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y, dp, dx, _ = _grads(model, variables, x, dy)
    w = np.asarray(variables["params"]["kernel"])
    xq = _q(np.asarray(x), scales["input_meta"], ml_dtypes.float8_e4m3fn).astype(np.float64)
    wq = _q(w, scales["kernel_meta"], ml_dtypes.float8_e4m3fn).astype(np.float64)
    dyq = _q(np.asarray(dy), scales["grad_meta"], ml_dtypes.float8_e5m2).astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), xq @ wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), dyq @ wq.T, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.asarray(dp["kernel"]), xq.T @ dyq, rtol=1e-5, atol=1e-8)


def test_dense_general_multi_axis_vs_float64():
    recipe = RECIPES[0]
    model = fj.DenseGeneral(features=(6, 5), axis=(-2, -1), use_bias=False)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 11, 4, 8)).astype(np.float32))
    dy = jnp.asarray(rng.standard_normal((3, 11, 6, 5)).astype(np.float32) * 1e-2)
    variables = _calibrated(model, recipe, x, dy)
    with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
        y, dp, dx, _ = _grads(model, variables, x, dy)
    w = np.asarray(variables["params"]["kernel"], np.float64)
    assert w.shape == (4, 8, 6, 5)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    assert sqnr_db(np.einsum("abij,ijkl->abkl", x64, w), y) >= 25
    assert sqnr_db(np.einsum("abkl,ijkl->abij", dy64, w), dx) >= 18
    assert sqnr_db(np.einsum("abij,abkl->ijkl", x64, dy64), dp["kernel"]) >= 18


def test_layernorm_mlp_and_dense_vs_high_precision():
    """FP8 LayerNormMLP / LayerNormDenseGeneral vs the same weights run in float32 with FP8 disabled."""
    recipe = RECIPES[0]
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((40, 32)).astype(np.float32))
    for model, out_dim in (
        (fj.LayerNormMLP(intermediate_dim=64, layernorm_type="layernorm"), 32),
        (fj.LayerNormDenseGeneral(24, layernorm_type="rmsnorm", return_layernorm_output=True), 24),
    ):
        dy = jnp.asarray(rng.standard_normal((40, out_dim)).astype(np.float32) * 1e-2)
        variables = _calibrated(model, recipe, x, dy)
        metas = variables[fj.FP8_COLLECTION]
        n_gemms = len(jax.tree_util.tree_leaves(metas, is_leaf=lambda m: isinstance(m, fj.Fp8Meta))) // 3
        assert n_gemms == (2 if isinstance(model, fj.LayerNormMLP) else 1)

        def hp_loss(params, x):
            out = model.apply({"params": params}, x)
            y = out[0] if isinstance(out, tuple) else out
            return jnp.sum(y * dy), out

        with fj.fp8_autocast(enabled=False):
            grad_fn = jax.jit(jax.value_and_grad(hp_loss, argnums=(0, 1), has_aux=True))
            (_, ref), (ref_dp, ref_dx) = grad_fn(variables["params"], x)

        def loss(params, metas, x):
            out = model.apply({"params": params, fj.FP8_COLLECTION: metas}, x)
            y = out[0] if isinstance(out, tuple) else out
            return jnp.sum(y * dy), out

        with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
            (_, out), (dp, _, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
                variables["params"], metas, x
            )
        if isinstance(out, tuple):  # LayerNormDenseGeneral: the norm output is high precision, equal
            np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), rtol=1e-6, atol=1e-6)
            out, ref = out[0], ref[0]
        assert sqnr_db(ref, out) >= 18  # two FP8 layers (MLP) or one plus the norm
        assert sqnr_db(ref_dx, dx) >= 18
        for leaf_ref, leaf in zip(jax.tree_util.tree_leaves(ref_dp), jax.tree_util.tree_leaves(dp)):
            assert sqnr_db(leaf_ref, leaf) >= 15  # norm/bias grads through two E5M2 casts


def _dq_reference_dot(x, w, dims, metas, encodings, dy):
    """y, dx, dw of the dequantize-then-dot emulation (the op's previous form): the FP8 roundings with the
    metas' scales, then ``jax.vjp`` of ``lax.dot_general`` in float32 (any dimension numbers)."""
    fwd, bwd = (fj.dot.FP8_DTYPES[e] for e in encodings)

    def qdq(a, meta, dtype):
        return fj.dot.dequantize(fj.dot.quantize(a, meta.scale, dtype), meta.scale_inv, jnp.float32)

    xq, wq = qdq(x, metas[0], fwd), qdq(w, metas[1], fwd)
    y, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), xq, wq)
    dx, dw = vjp(qdq(dy, metas[2], bwd))
    return y, dx, dw


def _metas(arrays, encodings, rng):
    """Metas with non-trivial scales (fp8_max / amax / random factor), random history, per operand."""
    fmax = [448.0, 448.0, 448.0 if encodings[1] == "e4m3" else 57344.0]
    out = []
    for a, m in zip(arrays, fmax):
        scale = np.float32(m / float(jnp.max(jnp.abs(a))) / rng.uniform(1.0, 2.0))
        out.append(
            fj.Fp8Meta(
                fp8_max=jnp.float32(m),
                amax_history=jnp.asarray(rng.uniform(0, 1, 4), jnp.float32),
                scale=jnp.float32(scale),
                scale_inv=jnp.float32(1.0) / jnp.float32(scale),
            )
        )
    return out


@pytest.mark.parametrize("encodings", [("e4m3", "e5m2"), ("e4m3", "e4m3")], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize(
    "x_shape, w_shape, dims",
    [
        ((37, 48), (48, 24), (((1,), (0,)), ((), ()))),  # DenseGeneral
        ((5, 7, 16, 3), (3, 16, 11), (((3, 2), (0, 1)), ((), ()))),  # two contracted axes, out of order
        ((4, 9, 16), (4, 16, 10), (((2,), (1,)), ((0,), (0,)))),  # batch axis
        ((16, 6, 4), (10, 4, 16), (((0,), (2,)), ((2,), (1,)))),  # batch and contracting axes not leading/trailing
    ],
    ids=["2d", "multi-contract", "batch", "permuted"],
)
def test_fp8_dot_general_dims_equal_dequantized_reference(encodings, x_shape, w_shape, dims):
    """The FP8-operand GEMMs (scale after the dot) equal the dequantize-then-dot emulation for any
    dimension numbers, forward and both gradients, to float32 rounding; the meta cotangents carry the amaxes."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal(x_shape).astype(np.float32) * 3.0)
    w = jnp.asarray(rng.standard_normal(w_shape).astype(np.float32) * 0.1)
    y_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), x, w).shape
    dy = jnp.asarray(rng.standard_normal(y_shape).astype(np.float32) * 1e-3)
    metas = _metas((x, w, dy), encodings, rng)

    def f(x, w, mx, mw, mg):
        return fj.fp8_dot_general(x, w, dims, mx, mw, mg, fwd_encoding=encodings[0], bwd_encoding=encodings[1])

    y, vjp = jax.vjp(jax.jit(f), x, w, *metas)
    dx, dw, dmx, dmw, dmg = vjp(dy)
    ry, rdx, rdw = _dq_reference_dot(x, w, dims, metas, encodings, dy)
    for got, ref in ((y, ry), (dx, rdx), (dw, rdw)):
        assert got.shape == ref.shape and got.dtype == jnp.float32
        atol = 1e-6 * float(jnp.max(jnp.abs(ref)))  # float32 accumulation-order rounding
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=atol)
    for dm, m, a in ((dmx, metas[0], x), (dmw, metas[1], w), (dmg, metas[2], dy)):
        expect = np.asarray(m.amax_history).copy()
        expect[0] = max(expect[0], float(jnp.max(jnp.abs(a))))
        np.testing.assert_array_equal(np.asarray(fj.to_float32(dm).amax_history), expect)


def test_fp8_dot_general_bf16_vs_float64():
    """bf16 compute dtype (the benchmark's): result and gradients in bf16, accurate to FP8 + bf16 rounding."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((96, 80)).astype(np.float32) * 0.1)
    dy = jnp.asarray(rng.standard_normal((64, 80)).astype(np.float32) * 1e-2)
    metas = _metas((x, w, dy), ("e4m3", "e5m2"), rng)
    dims = (((1,), (0,)), ((), ()))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y, vjp = jax.vjp(jax.jit(lambda a, b: fj.fp8_dot_general(a, b, dims, *metas)), xb, wb)
    dx, dw = vjp(dy.astype(jnp.bfloat16))
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    x64, w64, dy64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (xb, wb, dy.astype(jnp.bfloat16)))
    assert sqnr_db(x64 @ w64, y) >= 25  # E4M3 x and w
    assert sqnr_db(dy64 @ w64.T, dx) >= 18  # E5M2 dy
    assert sqnr_db(x64.T @ dy64, dw) >= 18


def test_fp8_dot_general_gemms_take_fp8_operands():
    """The three GEMMs are dot_generals on the FP8 arrays (the form XLA's GPU compiler rewrites into cuBLASLt
    FP8 GEMMs): E4M3 x E4M3 forward, E5M2 gradient x E4M3 operand backward, none in a wider dtype."""
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 48), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (48, 16), jnp.bfloat16)
    metas = [fj.meta.new_meta(m, 4) for m in (448.0, 448.0, 57344.0)]

    def loss(x, w):
        return jnp.sum(fj.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), *metas).astype(jnp.float32))

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()  # custom VJP inlined
    tensor = r"tensor<[0-9x]+x(\w+)>"
    dots = re.findall(rf"stablehlo\.dot_general .*: \({tensor}, {tensor}\) -> {tensor}", hlo)
    assert sorted(dots) == [
        ("f8E4M3FN", "f8E4M3FN", "bf16"),
        ("f8E4M3FN", "f8E5M2", "bf16"),
        ("f8E5M2", "f8E4M3FN", "bf16"),
    ], hlo
