"""The replay fails closed (``fp8engine.ops.replay``, STYLE.md pattern 11): a recording that reads a tensor's value
on the host is refused and its configuration runs the ordinary code from then on; writes are recognised by the
ops' schemas, not their names; the program cache is bounded (least recently used out first) and stops recording
configurations it sees once after a budget of them; ``FP8ENGINE_REPLAY=check`` runs the replay beside the ordinary
code and names the first output whose bits differ."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fp8engine
import fp8engine.ops.layer as layer_mod
from fp8engine.kernels._common import interpreting
from fp8engine.modules import RotaryEmbedding, TransformerLayer
from fp8engine.ops import replay, replay_cache
from tests.ops._ops_test_utils import record, replay_layer_steps, replay_unchecked  # noqa: F401 (autouse fixture)

H, FFN, HEADS, S, B = 64, 128, 4, 16, 2


# ---------------------------------------------------------------------------------------------------------------
# A function run through a cache as the layer step runs: recorded at a configuration's first call, replayed after
# ---------------------------------------------------------------------------------------------------------------
class _Cached:
    """``fn`` keyed by its inputs' :func:`~fp8engine.ops.replay.tensor_key` s in ``cache``, recorded and replayed
    as :class:`fp8engine.ops.layer._FP8TransformerLayer` does (one program, no backward). ``replays`` counts the
    calls that ran a program."""

    def __init__(self, fn, cache: replay_cache.ProgramCache):
        self.fn, self.cache, self.replays = fn, cache, 0

    def __call__(self, *inputs):
        key = tuple(replay.tensor_key(t) for t in inputs)
        state = self.cache.get(key)
        if type(state) is replay.Program:
            self.cache.move_to_end(key)
            self.replays += 1
            return state(inputs)[0]
        if not self.cache.start(key):
            return self.fn(*inputs)
        rec = replay.Recorder(inputs)
        with rec:
            out = self.fn(*inputs)
        try:
            self.cache[key] = replay.Program(rec, rec.template(out))
        except replay.RecordAbort as err:
            self.cache[key] = f"not replayed: {err}"
        return out




# ---------------------------------------------------------------------------------------------------------------
# Host reads abort the recording
# ---------------------------------------------------------------------------------------------------------------
_READS = {
    "__bool__": lambda a, b: b * 2 if a.sum() > 0 else b,
    "item": lambda a, b: b * a[0].item(),
    "tolist": lambda a, b: b * a.tolist()[0],
    "__int__": lambda a, b: b * int(a[0]),
    "__float__": lambda a, b: b * float(a[0]),
    "__index__": lambda a, b: b * [1.0, 2.0, 3.0][a[0].long().abs().clamp(max=2)],
    "equal": lambda a, b: b * 2 if torch.equal(a, b) else b,
    "allclose": lambda a, b: b * 2 if torch.allclose(a, b) else b,
    "nonzero": lambda a, b: b[: a.nonzero().shape[0]] * 2,
    "mask": lambda a, b: b[a > 0] * 2,
    "slice": lambda a, b: b[: a[0].long().abs() + 1] * 2,
    "format": lambda a, b: b * len(f"{a[0]}"),
}


@pytest.mark.parametrize("read", list(_READS))
def test_a_host_read_aborts_the_recording(read):
    """Each way the step's Python can see a tensor's value (a bool, a number, a list, a value-shaped result, a
    tensor slice bound) aborts the recording: no program."""
    a, b = torch.randn(6), torch.randn(6)
    rec, out = record(_READS[read], a, b)
    assert rec.error is not None, read
    with pytest.raises(replay.RecordAbort):
        replay.Program(rec, rec.template(out))


def test_a_branch_on_a_tensor_value_runs_the_ordinary_code_every_time():
    """``if a.sum() > 0``: the branch flips between calls of one configuration. The recording is refused at the
    first call, and every call gives the ordinary code's result; the configuration is recorded once, not at every
    call."""
    def fn(a):
        if a.sum() > 0:
            return a * 2
        return a - 1
    cache = replay_cache.ProgramCache()
    run = _Cached(fn, cache)
    for sign in (1, -1, 1, -1):
        a = torch.rand(8) * sign
        assert torch.equal(run(a), fn(a))
    assert cache.recordings == 1 and run.replays == 0
    assert "__bool__" in next(iter(cache.values()))


def test_a_slice_by_item_runs_the_ordinary_code_every_time():
    def fn(a, b):
        return b[: int(a[0].item())] * 2
    cache = replay_cache.ProgramCache()
    run = _Cached(fn, cache)
    b = torch.randn(10)
    for n in (3, 7, 5):
        a = torch.tensor([float(n), 0.0])
        got = run(a, b)
        assert got.shape == (n,) and torch.equal(got, fn(a, b))
    assert cache.recordings == 1 and run.replays == 0


def test_queries_and_conversions_are_still_not_recorded():
    """Shape / dtype / stride queries and a conversion to what a tensor already is steer only the Python: no op,
    no abort."""
    def fn(a):
        _ = a.shape, a.dtype, a.stride(), a.dim(), a.numel(), a.is_contiguous(), a.requires_grad
        return a.contiguous().float() * 2
    rec, out = record(fn, torch.randn(4))
    prog = replay.Program(rec, rec.template(out))
    assert prog.n_ops == 1, prog.source


def test_fused_step_with_a_branch_on_a_value_is_not_replayed(monkeypatch):
    """The layer step's Python with a branch on its input's value (patched in): the first call's recording is
    refused and every call, replay on, equals the ordinary step."""
    real = layer_mod._forward

    def branching(ctx, x, params, p):
        out = real(ctx, x, params, p)
        return out * 2 if x.sum() > 0 else out
    monkeypatch.setattr(layer_mod, "_forward", branching)
    torch.manual_seed(0)
    on = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    off = copy.deepcopy(on)
    base = torch.randn(S, B, H)
    xs = [base.abs(), -base.abs(), base.abs()]
    gs = [torch.randn(S, B, H) for _ in xs]
    a, cache, _ = _layer_steps(on, xs, gs, fp8engine.DelayedScaling(), True)
    b, _, _ = _layer_steps(off, xs, gs, fp8engine.DelayedScaling(), False)
    assert [type(v) for v in cache.values()] == [str] and "__bool__" in next(iter(cache.values()))
    for (y1, dx1), (y2, dx2) in zip(a, b):
        assert torch.equal(y1, y2) and torch.equal(dx1, dx2)


# ---------------------------------------------------------------------------------------------------------------
# Writes by schema
# ---------------------------------------------------------------------------------------------------------------
def _cummax(c, b):
    idx = torch.empty(c.shape, dtype=torch.long)
    torch._cummax_helper(b, c, idx, 0)  # writes c (values) and idx; returns None


_WRITES = {
    "OpOverload add_.Tensor": lambda c, b: torch.ops.aten.add_.Tensor(c, b),
    "OpOverloadPacket add_": lambda c, b: torch.ops.aten.add_(c, b),
    "OpOverload copy_.default": lambda c, b: torch.ops.aten.copy_.default(c, b),
    "OpOverload mul.out": lambda c, b: torch.ops.aten.mul.out(b, 3.0, out=c),
    "F.relu(inplace=True)": lambda c, b: F.relu(c.sub_(b), inplace=True),
    "torch.mul(out=)": lambda c, b: torch.mul(b, 2, out=c),
    "Tensor.add_": lambda c, b: c.add_(b),
    "+=": lambda c, b: c.__iadd__(b),
    "setitem": lambda c, b: c.__setitem__(slice(1, 3), b[:2]),
    "schema of a torch function (_cummax_helper)": _cummax,
    "batch_norm's running mean (unused output)": lambda c, b: F.batch_norm(b.view(2, 3), c[:3], c[3:].abs() + 1,
                                                                          training=True),
}


@pytest.mark.parametrize("write", list(_WRITES))
def test_a_write_is_recorded_whatever_the_op_is_called(write):
    """A write into a tensor the step made, by an ATen ``OpOverload`` (``add_.Tensor``: its name does not end in
    ``_``), a packet, a torch function with ``out=`` or ``inplace=True``, an in-place method, or a torch function
    whose ATen schema writes an argument: the replay runs it, and gives the ordinary code's result."""
    def fn(a, b):
        c = a * 1
        _WRITES[write](c, b)
        return c
    rec, out = record(fn, torch.randn(6), torch.randn(6))
    prog = replay.Program(rec, rec.template(out))
    for _ in range(2):
        a, b = torch.randn(6), torch.randn(6)
        got, _ = prog((a, b))
        assert torch.equal(got, fn(a, b)), prog.source


def test_a_packet_whose_out_overload_is_not_called_does_not_write():
    """``torch.ops.aten.mul(a, 2)`` (a packet with a ``mul.out`` overload, called without ``out=``) writes nothing:
    its unused result is dropped like any other."""
    def fn(a):
        torch.ops.aten.mul(a, 2)
        return a + 1
    rec, out = record(fn, torch.randn(4))
    prog = replay.Program(rec, rec.template(out))
    assert prog.n_ops == 1, prog.source


# ---------------------------------------------------------------------------------------------------------------
# The cache: miss budget, bound
# ---------------------------------------------------------------------------------------------------------------
def test_the_miss_budget_stops_recording_configurations_seen_once():
    """After ``miss_budget`` recordings at a configuration's first call, a new configuration runs the ordinary
    code; one that comes back is recorded at its second call and replayed after."""
    cache = replay_cache.ProgramCache(miss_budget=3)
    run = _Cached(lambda a: a * 2 + 1, cache)
    for n in range(1, 9):  # eight shapes, each once
        a = torch.randn(n)
        assert torch.equal(run(a), a * 2 + 1)
    assert cache.recordings == 3 and cache.misses == 3
    a = torch.randn(7)  # seen once, past the budget: recorded now
    assert torch.equal(run(a), a * 2 + 1) and cache.recordings == 4 and run.replays == 0
    assert torch.equal(run(a), a * 2 + 1) and run.replays == 1
    run(torch.randn(1))  # recorded at the first call, within the budget: replayed
    assert run.replays == 2 and cache.recordings == 4


def test_the_cache_is_bounded_least_recently_used_out_first():
    cache = replay_cache.ProgramCache(size=2)
    run = _Cached(lambda a: a + 1, cache)
    a, b, c = torch.randn(1), torch.randn(2), torch.randn(3)
    run(a), run(b)
    run(a)  # a replayed: b is now the least recently used
    run(c)
    assert len(cache) == 2 and [k[0][0] for k in cache] == [a.shape, c.shape]
    assert run.replays == 1
    run(a)  # still there
    assert run.replays == 2 and cache.recordings == 3


def test_fused_step_records_at_most_the_budget_of_new_shapes(monkeypatch):
    """A run whose sequence length changes at every step: the layer records ``miss_budget`` of them, then runs the
    ordinary step (the same results as replay off)."""
    monkeypatch.setattr(layer_mod, "_PROGRAMS", replay_cache.ProgramCache(miss_budget=2))
    recordings = []
    real = replay.Recorder.__init__
    monkeypatch.setattr(replay.Recorder, "__init__", lambda self, inputs, outer=None: (
        recordings.append(outer is None), real(self, inputs, outer))[1])
    torch.manual_seed(0)
    on = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    off = copy.deepcopy(on)
    xs = [torch.randn(s, B, H) for s in (8, 10, 12, 14)]
    gs = [torch.randn_like(x) for x in xs]
    a, cache, n = _layer_steps(on, xs, gs, fp8engine.DelayedScaling(), True)
    b, _, _ = _layer_steps(off, xs, gs, fp8engine.DelayedScaling(), False)
    assert recordings.count(True) == 2 and n == 2
    assert [type(v) for v in cache.values()] == [replay.Pair, replay.Pair]
    for (y1, dx1), (y2, dx2) in zip(a, b):
        assert torch.equal(y1, y2) and torch.equal(dx1, dx2)


# ---------------------------------------------------------------------------------------------------------------
# FP8ENGINE_REPLAY=check
# ---------------------------------------------------------------------------------------------------------------
_layer_steps = replay_layer_steps


def test_check_mode_is_read_from_the_environment():
    code = "import fp8engine.ops.replay_cache as r, fp8engine.ops.layer as l; print(r.CHECK, l.REPLAY)"
    env = {**os.environ, "FP8ENGINE_REPLAY": "check"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["True", "True"]


def _check_run(recipe, rope: bool, kernels: bool, steps: int, corrupt=None):
    """``steps`` layer steps under ``FP8ENGINE_REPLAY=check`` (``replay_cache.CHECK``), ``corrupt(checked)`` applied to
    the stored program after the first; against the same steps with replay off. Returns how many forwards and
    backwards were checked."""
    torch.manual_seed(0)
    on = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    off = copy.deepcopy(on)
    freqs = RotaryEmbedding(H // HEADS)(S) if rope else None
    xs = [torch.randn(S, B, H) for _ in range(steps)]
    gs = [torch.randn(S, B, H) for _ in range(steps)]
    counts = {"forward": 0, "backward": 0}
    real_f, real_b = replay_cache.Checked.forward, replay_cache._CheckedBackward.backward

    def fwd(self, *a):
        counts["forward"] += 1
        return real_f(self, *a)

    def bwd(self, *a):
        counts["backward"] += 1
        return real_b(self, *a)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay_cache, "CHECK", True)
        mp.setattr(replay_cache.Checked, "forward", fwd)
        mp.setattr(replay_cache._CheckedBackward, "backward", bwd)
        if corrupt is not None:
            real_setitem = replay_cache.ProgramCache.__setitem__

            def setitem(cache, key, value):
                real_setitem(cache, key, value)
                if type(cache[key]) is replay_cache.Checked:
                    corrupt(cache[key])
            mp.setattr(replay_cache.ProgramCache, "__setitem__", setitem)
        a, cache, _ = _layer_steps(on, xs, gs, recipe, True, freqs, kernels)
    b, _, _ = _layer_steps(off, xs, gs, recipe, False, freqs, kernels)
    assert [type(v) for v in cache.values()] == [replay_cache.Checked], cache
    for (y1, dx1), (y2, dx2) in zip(a, b):
        assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    for (name, p1), p2 in zip(on.named_parameters(), off.parameters()):
        assert torch.equal(p1.grad, p2.grad), name
    for (name, b1), b2 in zip(on.named_buffers(), off.buffers()):
        assert torch.equal(b1, b2), name
    return counts


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_check_mode_passes_on_the_fused_step(recipe):
    """The real layer step: each replayed forward and backward is compared with the ordinary code (outputs, every
    gradient, the scaling state it writes) and agrees; the results are the ordinary step's."""
    assert _check_run(recipe, True, False, 3) == {"forward": 2, "backward": 2}


@pytest.mark.skipif(not interpreting(), reason="the Triton kernel path on CPU needs TRITON_INTERPRET=1")
def test_check_mode_passes_on_the_fused_step_on_the_kernel_path():
    assert _check_run(fp8engine.DelayedScaling(), True, True, 2) == {"forward": 1, "backward": 1}


def _perturb_output(program, index: int):
    """Make ``program`` (a :class:`~fp8engine.ops.replay.Program`) return its output ``index`` moved by 0.1 % of
    its largest magnitude."""
    real = program._fn

    def fn(inputs, outer):
        outs, kept = real(inputs, outer)
        outs = list(outs)
        outs[index] = outs[index] + outs[index].abs().max() * 1e-3
        return tuple(outs), kept
    program._fn = fn


def test_check_mode_names_a_corrupted_forward_output():
    with pytest.raises(replay_cache.ReplayMismatch, match="replayed forward's output 0 differs"):
        _check_run(fp8engine.DelayedScaling(), False, False, 2, lambda c: _perturb_output(c.pair.fwd, 0))


def test_check_mode_names_a_corrupted_gradient():
    """The backward's output 3: the QKV weight's gradient (x, the first norm's weight and bias come before)."""
    with pytest.raises(replay_cache.ReplayMismatch, match="replayed backward's output 3 differs"):
        _check_run(fp8engine.DelayedScaling(), False, False, 2, lambda c: _perturb_output(c.pair.bwd, 3))


def test_check_mode_names_a_corrupted_written_tensor():
    """The replayed forward writes a wrong scaling state (the last input: an amax): named as the input it is."""
    def corrupt(checked):
        real = checked.pair.fwd._fn

        def fn(inputs, outer):
            result = real(inputs, outer)
            inputs[-1].add_(1.0)
            return result
        checked.pair.fwd._fn = fn
    with pytest.raises(replay_cache.ReplayMismatch, match=r"input \d+ of the replayed forward, which the step writes"):
        _check_run(fp8engine.DelayedScaling(), False, False, 2, corrupt)
