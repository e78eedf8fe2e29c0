import contextvars

import pytest
import torch

import fp8engine as fe
from fp8engine.fp8.autocast import get_fp8_context


def test_nesting_restores_outer():
    assert fe.get_fp8_recipe() is None
    outer, inner = fe.DelayedScaling(margin=1), fe.CurrentScaling()
    with fe.fp8_autocast(fp8_recipe=outer):
        assert fe.get_fp8_recipe() is outer
        with fe.autocast(recipe=inner):
            assert fe.get_fp8_recipe() is inner
            with fe.autocast(enabled=False):
                assert fe.get_fp8_recipe() is None
            assert fe.get_fp8_recipe() is inner
        assert fe.get_fp8_recipe() is outer
    assert fe.get_fp8_recipe() is None


def test_default_recipe_is_delayed_scaling():
    with fe.autocast():
        assert fe.get_fp8_recipe() == fe.DelayedScaling()


def test_context_is_per_context_not_global():
    seen = []
    with fe.autocast():
        # A fresh contextvars context (e.g. another thread or task) does not inherit ours.
        contextvars.Context().run(lambda: seen.append(fe.get_fp8_recipe()))
    assert seen == [None]


def test_exception_restores_and_skips_update():
    lin = fe.Linear(16, 16)
    with pytest.raises(RuntimeError):
        with fe.autocast():
            lin(torch.randn(4, 16))
            raise RuntimeError("boom")
    assert get_fp8_context() is None
    assert torch.equal(lin.fp8_state.scale, torch.ones(3))  # no update from a failed region


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="DelayedScaling"):
        with fe.autocast(recipe="hybrid"):
            pass


def test_delayed_vs_current_on_a_range_jump():
    """Delayed scaling uses past amaxes: after a 100x range jump its first cast saturates; current scaling adapts."""
    torch.manual_seed(0)
    small, big = torch.randn(64, 32), torch.randn(64, 32) * 100
    st_lin = fe.Linear(32, 16)
    recipe = fe.DelayedScaling(fp8_format=fe.Format.E4M3, amax_history_len=1)
    with fe.autocast(recipe=recipe):
        st_lin(small)
    assert st_lin.fp8_state.scale[0] == 448.0 / small.abs().max()
    from fp8engine.fp8.quantizer import get_quantizers

    with fe.autocast(recipe=recipe) as ctx:
        q_delayed = get_quantizers(st_lin.fp8_state, ctx)[0].input.quantize(big)
    with fe.autocast(recipe=fe.CurrentScaling(fe.Format.E4M3)) as ctx:
        q_current = get_quantizers(st_lin.fp8_state, ctx)[0].input.quantize(big)
    err_delayed = (q_delayed.dequantize(torch.float32) - big).norm() / big.norm()
    err_current = (q_current.dequantize(torch.float32) - big).norm() / big.norm()
    assert err_current < 0.05 < err_delayed  # saturation at the stale scale costs > 5 %
    assert st_lin.fp8_state.scale[0] == 448.0 / big.abs().max()  # and the next delayed step has adapted


_AUTOCASTS = {  # how each entry point names the group: (fn, recipe keyword, older group keyword)
    "autocast": (fe.autocast, "recipe", "amax_group"),
    "fp8_autocast": (fe.fp8_autocast, "fp8_recipe", "fp8_group"),
}


@pytest.mark.parametrize("entry", list(_AUTOCASTS))
@pytest.mark.parametrize("keyword", ["amax_reduction_group", "older"])
def test_amax_reduction_group_reaches_the_reduction(entry, keyword, monkeypatch):
    """TransformerEngine 2.x's ``amax_reduction_group`` names the same group as ``amax_group`` / ``fp8_group``: it
    is the region's group and the one the scale update reduces amaxes over (recorded here instead of reduced)."""
    import fp8engine.fp8.amax as amax

    seen = []
    monkeypatch.setattr(amax, "all_reduce_current_amax", lambda histories, group: seen.append(group))
    fn, recipe_kw, older = _AUTOCASTS[entry]
    group = object()  # stands for a process group: only its identity matters here
    lin = fe.Linear(16, 16)
    name = "amax_reduction_group" if keyword == "amax_reduction_group" else older
    with fn(**{recipe_kw: fe.DelayedScaling(), name: group}) as ctx:
        assert ctx.amax_group is group
        lin(torch.randn(4, 16))
    assert seen == [group]


@pytest.mark.parametrize("entry", list(_AUTOCASTS))
def test_amax_reduction_group_and_its_older_name_together(entry):
    fn, _, older = _AUTOCASTS[entry]
    group = object()
    with fn(**{older: group, "amax_reduction_group": group}) as ctx:  # the same group twice: accepted
        assert ctx.amax_group is group
    with pytest.raises(TypeError, match=f"{older} and amax_reduction_group .* pass only one"):
        with fn(**{older: group, "amax_reduction_group": object()}):
            pass
