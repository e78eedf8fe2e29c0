import pytest

from fp8engine.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Format


def test_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.interval, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0, Format.HYBRID, 1, 1024, "max", True)
    assert Format.HYBRID.fwd == "e4m3" and Format.HYBRID.bwd == "e5m2"
    assert Format.E4M3.fwd_max == 448.0 and Format.E5M2.bwd_max == 57344.0


@pytest.mark.parametrize("field,value", [
    ("margin", -1), ("interval", 0), ("amax_history_len", 0), ("amax_compute_algo", "mean"),
    ("fp8_format", "hybrid"), ("reduce_amax", "yes"), ("interval", 1.5),
])
def test_invalid_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DelayedScaling(**{field: value})


def test_current_scaling_validates_format():
    with pytest.raises(ValueError, match="fp8_format"):
        CurrentScaling(fp8_format="e4m3")


def test_float8_current_scaling_is_transformer_engines_name_of_current_scaling():
    from fp8engine import recipe

    assert "Float8CurrentScaling" in recipe.__all__ and recipe.Float8CurrentScaling is CurrentScaling
    r = recipe.Float8CurrentScaling(fp8_format=Format.E4M3)
    assert r == CurrentScaling(fp8_format=Format.E4M3) and type(r) is CurrentScaling
    assert recipe.Float8CurrentScaling() == CurrentScaling() != CurrentScaling(fp8_format=Format.E4M3)


def test_callable_algo_and_frozen():
    r = DelayedScaling(amax_compute_algo=lambda h: h.amax(-1))
    with pytest.raises(Exception):
        r.margin = 2  # frozen dataclass


def test_recipe_module_does_not_import_torch():
    import subprocess
    import sys

    import fp8engine.recipe as recipe_module

    # Importing the package __init__ pulls torch; load recipe.py as a standalone module instead.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('r', sys.argv[1]);"
            "m = importlib.util.module_from_spec(spec); sys.modules['r'] = m; spec.loader.exec_module(m);"
            "assert 'torch' not in sys.modules, 'recipe imported torch'")
    subprocess.run([sys.executable, "-c", code, recipe_module.__file__], check=True)


# ---------------------------------------------------------------------------------------------------------------
# Float8BlockScaling
# ---------------------------------------------------------------------------------------------------------------
def test_block_scaling_defaults_and_export():
    import fp8engine

    r = Float8BlockScaling()
    assert (r.fp8_format, r.power_2_scale, Float8BlockScaling.BLOCK_SIZE) == (Format.E4M3, True, 128)
    assert fp8engine.Float8BlockScaling is Float8BlockScaling and "Float8BlockScaling" in fp8engine.__all__
    assert Float8BlockScaling(Format.HYBRID).fp8_format.bwd == "e5m2"
    with pytest.raises(Exception):
        r.power_2_scale = False  # frozen dataclass


@pytest.mark.parametrize("kwargs,match", [
    ({"fp8_format": Format.E5M2}, "E5M2 is not supported"),
    ({"fp8_format": "e4m3"}, "fp8_format"),
    ({"power_2_scale": 1}, "power_2_scale"),
])
def test_block_scaling_invalid_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8BlockScaling(**kwargs)


def test_autocast_accepts_block_scaling_and_the_modules_run_it():
    """fp8_autocast takes the recipe and every FP8 module and parallel layer runs its GEMMs block-scaled (their
    numerics: tests/modules/test_block_modules.py, tests/parallel/test_block_parallel.py); a layer whose dims are
    multiples of 16 but not of 128 is refused at its first forward with an error naming the dim."""
    import torch

    import fp8engine
    from fp8engine.fp8.autocast import get_fp8_recipe
    from fp8engine.parallel.layers import ColumnParallelLinear

    recipe = Float8BlockScaling()
    x = torch.randn(4, 2, 128)  # [s, b, h]
    layers = [fp8engine.Linear(128, 128), fp8engine.LayerNormMLP(128, 256),
              fp8engine.TransformerLayer(128, 256, 2, hidden_dropout=0.0, attention_dropout=0.0),
              ColumnParallelLinear(128, 128, tp_group=None)]
    with fp8engine.fp8_autocast(enabled=True, fp8_recipe=recipe):
        assert get_fp8_recipe() is recipe
        for layer in layers:
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            assert y.shape[:2] == (4, 2) and torch.isfinite(y).all()
        for layer in (fp8engine.Linear(128, 48), ColumnParallelLinear(48, 128, tp_group=None)):
            with pytest.raises(ValueError, match="=48 .*not a multiple of 128.*Float8BlockScaling"):
                layer(x[..., :layer.weight.shape[1]])
