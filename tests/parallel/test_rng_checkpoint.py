"""Megatron-core / TransformerEngine parity of ``fp8engine.parallel.random`` and ``VocabUtility``:

* nested ``RNGStatesTracker.fork`` continues the stream (draws bit-equal to one un-nested stream of the same draws),
  also across an activation-checkpoint recompute inside a fork region;
* ``model_parallel_manual_seed`` seeds only the generator the tracker swaps (Megatron's
  ``model_parallel_cuda_manual_seed`` leaves the CPU generator alone);
* ``checkpoint(function, distribute_saved_activations, *args)`` and ``te_checkpoint`` (reentrant and not) give the
  outputs, gradients, FP8 amax histories and scales of the same steps without checkpointing, exactly;
* ``distribute_saved_activations=True`` keeps 1/tp of the input per rank, on real gloo groups: the world group of 2
  ranks here; of 8 ranks, and two tensor-parallel groups of 4 inside 8 ranks, in test_world_size_8.py;
* ``VocabUtility`` against Megatron's formulas.
"""
import pytest
import torch
import torch.nn.functional as F

from _parallel_harness import run_ranks, tp_groups
from fp8engine.fp8.autocast import fp8_autocast
from fp8engine.modules.layernorm_mlp import LayerNormMLP
from fp8engine.modules.linear import Linear
from fp8engine.parallel import (RNGStatesTracker, VocabUtility, checkpoint, model_parallel_manual_seed,
                                te_checkpoint)
import fp8engine.parallel.random as random_mod
from fp8engine.parallel.random import MODEL_PARALLEL_RNG
from fp8engine.recipe import DelayedScaling


def _exact(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# RNG tracker: nested forks.

def test_nested_fork_continues_the_stream():
    """``fork(a)`` inside ``fork(a)`` (and ``fork(a)`` inside ``fork(b)`` inside ``fork(a)``) draws what one
    un-nested stream of the same draws gives, bit for bit; the state left after the regions is that stream's
    state; the default generator is untouched."""
    tr = RNGStatesTracker("cpu")
    tr.add("a", 5)
    tr.add("b", 6)
    ref_a, ref_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    torch.manual_seed(99)
    default_before = torch.get_rng_state()
    with tr.fork("a"):
        d1 = torch.rand(3)
        with tr.fork("a"):           # e.g. a checkpoint recompute inside a fork region
            d2 = torch.randn(4)
        d3 = torch.rand(2)           # the outer region goes on after the inner one's draws
        with tr.fork("b"):
            e1 = torch.rand(3)
            with tr.fork("a"):       # a inside b inside a
                d4 = torch.rand(5)
            e2 = torch.rand(2)
        d5 = torch.rand(1)
    with tr.fork("a"):
        d6 = torch.rand(3)
    _exact(torch.get_rng_state(), default_before, "default generator")
    want = [torch.rand(3, generator=ref_a), torch.randn(4, generator=ref_a), torch.rand(2, generator=ref_a),
            torch.rand(5, generator=ref_a), torch.rand(1, generator=ref_a), torch.rand(3, generator=ref_a)]
    for i, (got, w) in enumerate(zip((d1, d2, d3, d4, d5, d6), want)):
        _exact(got, w, f"stream a, draw {i + 1}")
    _exact(torch.cat([e1, e2]), torch.cat([torch.rand(3, generator=ref_b), torch.rand(2, generator=ref_b)]),
           "stream b")
    states = tr.get_states()
    _exact(states["a"], ref_a.get_state(), "state a after the regions")
    _exact(states["b"], ref_b.get_state(), "state b after the regions")


def test_fork_restores_on_exception_and_get_states_inside_fork():
    tr = RNGStatesTracker("cpu")
    tr.add("a", 5)
    ref = torch.Generator().manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError):
        with tr.fork("a"):
            torch.rand(2)
            with tr.fork("a"):
                torch.rand(3)
                1 / 0
    _exact(torch.get_rng_state(), before, "default generator after an exception")
    torch.rand(2, generator=ref), torch.rand(3, generator=ref)
    with tr.fork("a"):
        torch.rand(4)
        torch.rand(4, generator=ref)
        _exact(tr.get_states()["a"], ref.get_state(), "get_states inside a fork: the live state")
    assert tr._active is None


def _fork_block(lin, tracker):
    def fn(x):
        h = lin(x)
        with tracker.fork():
            h = F.dropout(h, p=0.5)    # nested in the caller's fork region
        return F.dropout(h, p=0.3)     # the caller's (forked) stream again, after the inner region
    return fn


@pytest.mark.parametrize("which", ["checkpoint", "te_reentrant", "te_non_reentrant"])
def test_checkpoint_inside_fork_region(which):
    """The checkpointed function runs inside ``tracker.fork()`` and forks again: the recompute must replay the
    forward's draws (the inner fork continues the outer stream, and the outer stream resumes after it), so the
    gradients and the tracker's states equal those without checkpointing, exactly."""
    results = []
    for use_ckpt in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 16)
        tracker = model_parallel_manual_seed(7, 0, RNGStatesTracker("cpu"))
        x = torch.randn(8, 16, requires_grad=True)
        fn = _fork_block(lin, tracker)
        with tracker.fork():
            torch.rand(3)  # the outer region has drawn before the checkpoint
            if not use_ckpt:
                y = fn(x)
            elif which == "checkpoint":
                y = checkpoint(fn, False, x, rng_tracker=tracker)
            else:
                y = te_checkpoint(fn, x, get_rng_state_tracker=lambda: tracker,
                                  use_reentrant=which == "te_reentrant")
            after = torch.rand(3)
        (y * torch.linspace(-1, 1, 16)).sum().backward()
        results.append((y.detach(), after, x.grad, lin.weight.grad, tracker.get_states()[MODEL_PARALLEL_RNG],
                        torch.get_rng_state()))
    for name, a, b in zip(("out", "draw after", "x.grad", "w.grad", "tracker state", "cpu state"), *results):
        _exact(a, b, name)


# ---------------------------------------------------------------------------------------------------------------
# model_parallel_manual_seed.

class _FakeCuda:
    """A CUDA default generator stand-in (a CPU ``torch.Generator``) for ``torch.cuda.{manual_seed,get_rng_state,
    set_rng_state}``, to check on a CPU machine which generators model_parallel_manual_seed(device="cuda") seeds."""

    def __init__(self, monkeypatch):
        self.gen = torch.Generator().manual_seed(12345)
        monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: self.gen.manual_seed(seed))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.gen.get_state())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.gen.set_state(state))
        monkeypatch.setattr(random_mod, "_generator",  # the graph-safe tracker's handle on the CUDA generator
                            lambda device_type: self.gen if device_type == "cuda" else torch.default_generator)


def test_manual_seed_cuda_leaves_cpu_generator_alone(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    torch.manual_seed(321)
    cpu_before = torch.get_rng_state()
    tracker = model_parallel_manual_seed(1000, 3, RNGStatesTracker("cuda"), device="cuda")
    _exact(torch.get_rng_state(), cpu_before, "default CPU generator")   # Megatron: untouched
    _exact(fake.gen.get_state(), torch.Generator().manual_seed(1000).get_state(), "cuda generator = data seed")
    states = tracker.get_states()
    _exact(states[MODEL_PARALLEL_RNG], torch.Generator().manual_seed(1000 + 2718 + 3).get_state(), "tp state")
    _exact(states["expert-parallel-rng"], torch.Generator().manual_seed(1000 + 1024 + 3).get_state(), "ep state")
    with pytest.raises(ValueError, match="device"):
        model_parallel_manual_seed(1, 0, RNGStatesTracker("cpu"), device="cuda")


def test_manual_seed_cpu_seeds_the_cpu_generator():
    """device="cpu": the tracker swaps the default CPU generator, which is seeded with the data-parallel seed."""
    torch.manual_seed(321)
    tracker = model_parallel_manual_seed(1000, 1, RNGStatesTracker("cpu"))
    got = torch.rand(5)
    _exact(got, torch.rand(5, generator=torch.Generator().manual_seed(1000)), "data-parallel stream")
    with tracker.fork():
        tp = torch.rand(5)
    _exact(tp, torch.rand(5, generator=torch.Generator().manual_seed(1000 + 2718 + 1)), "tensor-parallel stream")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_manual_seed_cuda_real():
    torch.manual_seed(321)
    cpu_before = torch.get_rng_state()
    tracker = model_parallel_manual_seed(1000, 0, RNGStatesTracker("cuda"), device="cuda")
    _exact(torch.get_rng_state(), cpu_before, "default CPU generator")
    got = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(1000)
    _exact(got, torch.rand(5, device="cuda"), "cuda data-parallel stream")
    assert MODEL_PARALLEL_RNG in tracker.get_states()


def _fork_draws(tracker) -> torch.Tensor:
    """One 'step': draws from the default stream, the model-parallel fork, a nested fork of it, and the default
    stream again (a [4, 8] tensor)."""
    a = torch.rand(8, device="cuda")
    with tracker.fork():
        b = torch.rand(8, device="cuda")
        with tracker.fork():
            c = torch.rand(8, device="cuda")
    return torch.stack([a, b, c, torch.rand(8, device="cuda")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracker_forks_inside_cuda_graph_replay_the_eager_streams():
    """A graph-safe tracker: forks captured in a CUDA graph (its states registered) draw on every replay exactly
    what the eager steps draw (2 eager steps, capture, 3 replays vs 5 eager steps of the same seeds)."""
    tracker = model_parallel_manual_seed(77, 1, RNGStatesTracker("cuda"), device="cuda")
    eager = [_fork_draws(tracker) for _ in range(5)]
    tracker = model_parallel_manual_seed(77, 1, RNGStatesTracker("cuda"), device="cuda")
    got = [_fork_draws(tracker) for _ in range(2)]
    graph = torch.cuda.CUDAGraph()
    for state in tracker.graph_states():
        graph.register_generator_state(state)
    with torch.cuda.graph(graph):
        static = _fork_draws(tracker)
    for _ in range(3):
        graph.replay()
        got.append(static.clone())
    for step, (g, e) in enumerate(zip(got, eager)):
        _exact(g, e, f"step {step}")
    saved = tracker.get_states()  # the states advanced by the replays, as by the eager steps
    tracker2 = model_parallel_manual_seed(77, 1, RNGStatesTracker("cuda"), device="cuda")
    [_fork_draws(tracker2) for _ in range(5)]
    for name, state in tracker2.get_states().items():
        _exact(saved[name], state, name)


# ---------------------------------------------------------------------------------------------------------------
# VocabUtility.

@pytest.mark.parametrize("vocab,world_size", [(64, 1), (64, 2), (96, 3), (64, 8), (50304, 8), (128, 4)])
def test_vocab_utility_matches_megatron(vocab, world_size):
    per = vocab // world_size  # Megatron: divide(global, world_size), then [rank * per, rank * per + per)
    ranges = []
    for rank in range(world_size):
        want = (rank * per, rank * per + per)
        assert VocabUtility.vocab_range_from_global_vocab_size(vocab, rank, world_size) == want
        assert VocabUtility.vocab_range_from_per_partition_vocab_size(per, rank, world_size) == want
        ranges.append(want)
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, last exclusive


def test_vocab_utility_errors():
    with pytest.raises(ValueError, match="130.*not divisible by 4"):
        VocabUtility.vocab_range_from_global_vocab_size(130, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        VocabUtility.vocab_range_from_global_vocab_size(128, 4, 4)
    with pytest.raises(ValueError, match="world_size"):
        VocabUtility.vocab_range_from_global_vocab_size(128, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        VocabUtility.vocab_range_from_per_partition_vocab_size(16, -1, 4)


# ---------------------------------------------------------------------------------------------------------------
# checkpoint / te_checkpoint on one process.

def test_checkpoint_signature_errors():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="distribute_saved_activations must be a bool"):
        checkpoint(lin, x)
    with pytest.raises(ValueError, match="view"):
        checkpoint(lin, True, x[:1])
    with pytest.raises(ValueError, match="tensor"):
        checkpoint(lambda a, b: b, True, 3, x)
    with pytest.raises(ValueError, match="positionally"):
        te_checkpoint(lambda a, b: a * b, x, b=torch.ones(2, 4, requires_grad=True))
    with pytest.warns(UserWarning, match="no effect"):
        te_checkpoint(lin, x, distribute_saved_activations=True, use_reentrant=False).sum().backward()


def test_distribute_without_grad_mode_keeps_the_input():
    """Under no_grad no backward will gather args[0] back, so it is left whole (Megatron would keep the chunk)."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4)
    want = x.clone()
    with torch.no_grad():
        y = checkpoint(lin, True, x)
    _exact(x, want, "input")
    _exact(y, lin(want).detach(), "output")


def test_checkpoint_keeps_torch_autocast():
    """The recompute runs under the forward's ``torch.autocast`` (bf16 on CPU): gradients equal the plain run's."""
    grads = []
    for use_ckpt in (False, True):
        torch.manual_seed(0)
        lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        x = torch.randn(8, 16, requires_grad=True)
        fn = lambda t: lin2(F.gelu(lin1(t)))  # noqa: E731
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(fn, False, x) if use_ckpt else fn(x)
        y.float().sum().backward()
        grads.append((y, x.grad, lin1.weight.grad, lin2.weight.grad))
    for name, a, b in zip(("out", "x.grad", "w1.grad", "w2.grad"), *grads):
        _exact(a, b, name)


def _fp8_module(kind):
    torch.manual_seed(0)
    if kind == "linear":
        return Linear(32, 48)
    return LayerNormMLP(32, 64)


@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_te_checkpoint_fp8_matches_plain(kind, use_reentrant):
    """te_checkpoint of an FP8 module under fp8_autocast(DelayedScaling): outputs, input and weight gradients,
    amax histories and scales equal the plain run's after 3 steps, exactly (the recompute uses the forward's scales
    and records no amax a second time; step 2 and 3 run after scale updates). Keyword arguments reach the module."""
    recipe = DelayedScaling(amax_history_len=4)
    results = []
    for use_ckpt in (False, True):
        mod = _fp8_module(kind)
        xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(s)) * (s + 1) for s in range(3)]
        for x in xs:
            x.requires_grad_(True)
            mod.zero_grad(set_to_none=True)
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                if use_ckpt:
                    y = te_checkpoint(mod, x, use_reentrant=use_reentrant, is_first_microbatch=None)
                else:
                    y = mod(x, is_first_microbatch=None)
            y = y[0] if isinstance(y, tuple) else y
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        states = [(st.amax_history.clone(), st.scale.clone()) for st in _scaling_states(mod)]
        assert states, "the module has no delayed-scaling state: the test would check nothing"
        results.append([y.detach(), xs[-1].grad] + [p.grad for p in mod.parameters()] +
                       [t for pair in states for t in pair])
    assert len(results[0]) == len(results[1])
    for i, (a, b) in enumerate(zip(*results)):
        _exact(a, b, f"item {i}")


def _scaling_states(mod):
    return [m.fp8_state for m in mod.modules() if getattr(m, "fp8_state", None) is not None]


def test_te_checkpoint_non_reentrant_supports_autograd_grad():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    g_plain, = torch.autograd.grad(torch.tanh(lin(x)).sum(), x)
    g_ckpt, = torch.autograd.grad(te_checkpoint(lambda t: torch.tanh(lin(t)), x, use_reentrant=False).sum(), x)
    _exact(g_ckpt, g_plain, "autograd.grad")


# ---------------------------------------------------------------------------------------------------------------
# distribute_saved_activations on gloo groups.

S, B, H = 4, 2, 8  # numel 64: divisible by 2, 4 and 8


def _distributed_checkpoint_case(group, group_index, tp_rank, tp, which):
    """One tensor-parallel group: the input is replicated inside the group (seeded by the group index, so the
    groups of 8 ranks hold different inputs and a gather from the wrong ranks would be seen)."""
    results, saved_numels = [], []
    x_full = torch.randn(S, B, H, generator=torch.Generator().manual_seed(50 + group_index))
    for use_ckpt in (False, True):
        torch.manual_seed(0)
        lin = torch.nn.Linear(H, H)
        tracker = model_parallel_manual_seed(123, tp_rank, RNGStatesTracker("cpu"))

        def fn(t):
            with tracker.fork():
                h = F.dropout(lin(t), p=0.5)  # tp-rank dependent mask, replayed by the recompute
            return F.gelu(h)

        x = x_full.clone().requires_grad_(True)
        if use_ckpt:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_numels.append(t.numel()) or t,
                                                         lambda t: t):
                if which == "megatron":
                    y = checkpoint(fn, True, x, rng_tracker=tracker, tp_group=group)
                else:
                    y = te_checkpoint(fn, x, distribute_saved_activations=True,
                                      get_rng_state_tracker=lambda: tracker, tp_group=group)
            # Megatron's semantics: the caller's tensor holds this rank's 1-D chunk until backward
            assert x.shape == (S * B * H // tp,), x.shape
            _exact(x.detach(), x_full.reshape(-1).chunk(tp)[tp_rank], "kept chunk")
        else:
            y = fn(x)
        (y * torch.linspace(-1, 1, H)).sum().backward()
        _exact(x.detach(), x_full, "input after backward")
        results.append((y.detach(), x.grad, lin.weight.grad, lin.bias.grad))
    assert saved_numels == [S * B * H // tp], saved_numels  # only the chunk is saved: 1/tp of the input
    for name, a, b in zip(("out", "x.grad", "w.grad", "b.grad"), *results):
        _exact(a, b, f"{which} tp={tp} group {group_index}: {name}")


def _distributed_checkpoint_check(group, group_index, tp_rank, tp):
    for which in ("megatron", "te"):
        _distributed_checkpoint_case(group, group_index, tp_rank, tp, which)


def _distributed_checkpoint_worker(rank, ws):
    group, group_index, tp_rank = tp_groups(ws)
    _distributed_checkpoint_check(group, group_index, tp_rank, ws)


def test_checkpoint_distribute_saved_activations_2_ranks():
    """(8 ranks, and two groups of 4 in 8 ranks: test_world_size_8.py.)"""
    run_ranks(_distributed_checkpoint_worker, 2)
