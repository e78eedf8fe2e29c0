"""fp8_autocast: accepted recipes, context capture at trace time, re-tracing per recipe, availability rules."""
import ast
import pathlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402

import fp8engine.jax as fj  # noqa: E402
from fp8engine.recipe import CurrentScaling, DelayedScaling  # noqa: E402


@pytest.mark.parametrize(
    "recipe, message",
    [
        (DelayedScaling(amax_compute_algo=lambda h: h[..., 0]), "amax_compute_algo"),
        (DelayedScaling(reduce_amax=False), "reduce_amax"),
        (CurrentScaling(), "DelayedScaling"),
    ],
)
def test_unsupported_recipes_raise(recipe, message):
    with pytest.raises(ValueError, match=message):
        with fj.fp8_autocast(enabled=True, fp8_recipe=recipe):
            pass


def test_bad_mesh_resource_raises():
    with pytest.raises(ValueError, match="MeshResource"):
        with fj.fp8_autocast(mesh_resource=("dp", "tp")):
            pass
    with pytest.raises(ValueError, match="different mesh axes"):
        fj.MeshResource("x", "x")


def test_defaults_nesting_and_restore():
    assert fj.get_fp8_context() == fj.Fp8Context()
    assert fj.get_delayed_scaling() == DelayedScaling()
    outer, inner = DelayedScaling(margin=1), DelayedScaling(margin=2, amax_compute_algo="most_recent")
    with fj.fp8_autocast(enabled=True, fp8_recipe=outer, mesh_resource=fj.MeshResource("data", "model")):
        assert fj.get_delayed_scaling() == outer and fj.get_fp8_context().enabled
        with fj.fp8_autocast(enabled=False, fp8_recipe=inner):
            assert fj.get_delayed_scaling() == inner and not fj.get_fp8_context().enabled
            assert fj.get_fp8_context().mesh_resource == fj.MeshResource()
        assert fj.get_delayed_scaling() == outer
    assert fj.get_fp8_context() == fj.Fp8Context()


def test_jitted_function_retraced_under_another_recipe():
    traces = []

    @jax.jit
    def new_scale(h):
        traces.append(fj.get_delayed_scaling())
        return fj.update_fp8_metas({"m": fj.Fp8Meta(jnp.float32(448.0), h, jnp.float32(1.0), jnp.float32(1.0))})

    h = jnp.asarray([4.0, 1.0], jnp.float32)
    with fj.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(margin=0)):
        s0 = float(new_scale(h)["m"].scale)
    with fj.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(margin=2)):
        s2 = float(new_scale(h)["m"].scale)
    with fj.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(margin=0)):
        s0_again = float(new_scale(h)["m"].scale)
    assert (s0, s2, s0_again) == (112.0, 28.0, 112.0)  # not the first trace's margin reused
    assert len(traces) == 2  # third call hit the cache of the first recipe


def test_dense_jitted_under_fp8_then_disabled_is_retraced():
    model = fj.DenseGeneral(8, use_bias=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    with fj.fp8_autocast(enabled=True):
        variables = model.init(jax.random.PRNGKey(1), x)
        apply = jax.jit(model.apply)
        y_fp8 = apply(variables, x)
    with fj.fp8_autocast(enabled=False):
        y_hp = apply(variables, x)  # same jitted callable: must trace the high-precision path
    exact = np.asarray(x) @ np.asarray(variables["params"]["kernel"])
    np.testing.assert_allclose(np.asarray(y_hp), exact, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(y_fp8), exact, rtol=1e-5, atol=1e-5)  # the FP8 result is rounded


def test_disabled_creates_no_metas():
    variables = jax.jit(fj.LayerNormMLP(intermediate_dim=8).init)(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    assert fj.FP8_COLLECTION not in variables


@pytest.mark.parametrize(
    "platform, cc, cuda, ok",
    [
        ("gpu", (9, 0), (12, 0), True),
        ("cuda", (10, 0), None, True),
        ("gpu", (8, 9), (12, 1), True),
        ("gpu", (8, 9), (12, 0), False),
        ("gpu", (8, 6), (12, 4), False),
        ("gpu", (7, 0), (12, 4), False),
        ("cpu", None, None, True),
        ("tpu", None, None, False),
    ],
)
def test_fp8_support_rules(platform, cc, cuda, ok):
    got, reason = fj.fp8_support(platform, cc, cuda)
    assert got is ok and reason
    if cc is not None and cc < (8, 9):
        assert reason == "Device compute capability 8.9 or higher required for FP8 execution."
    if platform == "cpu":
        assert "emulated" in reason


def test_is_fp8_available_on_this_machine():
    ok, reason = fj.is_fp8_available()
    if jax.local_devices()[0].platform == "cpu":
        assert ok and "emulated on CPU" in reason


def test_package_never_imports_torch():
    root = pathlib.Path(fj.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] != "torch", f"{path.name} imports {name}"
                if name.startswith("fp8engine."):
                    assert name.startswith(("fp8engine.jax", "fp8engine.recipe")), f"{path.name} imports {name}"
