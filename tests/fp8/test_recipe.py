import pytest

from fp8engine.recipe import CurrentScaling, DelayedScaling, Format


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
