"""The non-finite step guard (fp8engine/training/guard.py) on the CPU: what it snapshots, that a non-finite FP8
step leaves every scaling buffer bit-identical, and that its op count does not grow with the model."""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fp8engine
from fp8engine.fp8.state import ScalingState
from fp8engine.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_harness import run_ranks  # noqa: E402
from fp8engine.training.guard import NonFiniteGuard, step_state_buffers
from fp8engine.training.step import TrainStep, make_optimizer

_FP8_BUFFERS = ("amax_history", "scale", "update_step", "grad_amax")


def _model(n_layer=1, seed=0):
    torch.manual_seed(seed)
    # FP8-capable (multiples of 16) and small: one step takes milliseconds on a CPU
    return GPT(GPTConfig.from_name("tiny", n_layer=n_layer, hidden_size=32, ffn_hidden_size=64, n_head=2,
                                   max_seq_len=16, vocab_size=64))


def _states(model):
    return [m for m in model.modules() if isinstance(m, ScalingState)]


def _bits(model):
    """Every ScalingState buffer as raw bytes (NaN-safe exact comparison), keyed by qualified name."""
    return {f"{name}.{key}": getattr(st, key).detach().reshape(-1).view(torch.uint8).clone()
            for name, st in model.named_modules() if isinstance(st, ScalingState) for key in _FP8_BUFFERS}


def _train_step(model, guard):
    optimizer = make_optimizer(model, 1e-2, 0.1, torch.device("cpu"))
    return TrainStep(model, list(model.parameters()), optimizer,
                     lambda: fp8engine.fp8_autocast(True, fp8engine.DelayedScaling(amax_history_len=8)),
                     grad_accum=1, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0), guard=guard), optimizer


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (1, 3, 16), generator=g), torch.randint(0, 64, (1, 3, 16), generator=g)


def test_snapshot_holds_only_step_state():
    """The FP8 states' four buffers each, the persistent buffers of other modules (BatchNorm's running stats);
    not the rotary inv_freq (non-persistent: a constant no step writes)."""
    model = _model(n_layer=2)
    model.extra_norm = torch.nn.BatchNorm1d(4)  # persistent running_mean/var and num_batches_tracked
    guard = NonFiniteGuard(model)
    guard.snapshot()
    states = _states(model)
    assert len(states) == 6  # 3 FP8 modules per layer: layernorm_qkv, proj, layernorm_mlp
    assert guard.num_tensors == 4 * len(states) + 3
    assert "rotary.inv_freq" not in guard.names and any(n.endswith("inv_freq") for n, _ in model.named_buffers())
    assert {"extra_norm.running_mean", "extra_norm.running_var", "extra_norm.num_batches_tracked"} <= set(guard.names)
    assert [n for n, _ in step_state_buffers(model)] == guard.names


def test_nonfinite_fp8_step_leaves_scaling_state_bit_identical():
    """A step whose activations turn NaN (a forward hook, step 3 only) leaves every ScalingState buffer (amax
    histories, scales, update counters, grad amaxes), the weights and the AdamW state exactly as before it; the
    same step without the guard does change them (so the comparison can fail); the next good step trains."""
    model = _model()
    step, optimizer = _train_step(model, NonFiniteGuard(model))
    for i in (1, 2):  # good steps: non-zero amax histories, scales updated, AdamW state allocated
        assert float(step(*_batch(i))) > 0 and float(step.found_inf) == 0.0
    poison = {"on": True}
    model.layers[0].register_forward_hook(lambda mod, args, out: out * float("nan") if poison["on"] else None)
    unguarded = copy.deepcopy(model)
    before_bits, before_params = _bits(model), copy.deepcopy(model.state_dict())
    before_opt = copy.deepcopy(optimizer.state_dict())

    loss = step(*_batch(3))
    assert torch.isnan(loss) and float(step.found_inf) == 1.0
    after = _bits(model)
    assert after.keys() == before_bits.keys() and len(after) == 4 * len(_states(model))
    for name, bits in before_bits.items():
        assert torch.equal(after[name], bits), name
    for name, value in before_params.items():
        assert torch.equal(model.state_dict()[name], value), name
    for pid, st in before_opt["state"].items():
        for key, value in st.items():
            assert torch.equal(optimizer.state_dict()["state"][pid][key], value), (pid, key)

    plain, _ = _train_step(unguarded, None)
    plain(*_batch(3))
    changed = _bits(unguarded)
    assert any(not torch.equal(changed[name], bits) for name, bits in before_bits.items())

    poison["on"] = False
    assert torch.isfinite(step(*_batch(4))) and float(step.found_inf) == 0.0
    assert any(not torch.equal(_bits(model)[name], bits) for name, bits in before_bits.items())


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _guard_ops(n_layer):
    model = _model(n_layer=n_layer)
    guard = NonFiniteGuard(model)
    guard.snapshot()  # first call plans the flat buffers (allocations); count a steady-state step
    guard.check(torch.tensor(float("nan")), torch.tensor(1.0))
    with _CountOps() as counter:
        guard.snapshot()
        guard.restore_if_found()
    return counter.ops, len(_states(model))


def test_guard_op_count_does_not_grow_with_the_model():
    """Snapshot + restore dispatch the same few ops for 1 and 3 layers (3 and 9 FP8 states, 12 and 36
    buffers): foreach copies and one where over the flat buffer, not a copy per buffer."""
    small, n_small = _guard_ops(1)
    large, n_large = _guard_ops(3)
    assert (n_small, n_large) == (3, 9)
    assert small == large and len(small) <= 4, small
    assert small.count("aten._foreach_copy_.default") == 3


def test_restore_after_history_resize_matches_resized_snapshot():
    """A history reallocated during the step (resized to the recipe's length on first use) gets back the
    snapshot as ScalingState.resize_history would have resized it."""
    st = ScalingState(["input", "weight", "grad_output"], amax_history_len=8)
    st.amax_history.copy_(torch.rand(3, 8) + 0.5)
    st.scale.copy_(torch.rand(3) + 1.0)
    st.update_step.fill_(7)
    reference = copy.deepcopy(st)
    reference.resize_history(5)
    guard = NonFiniteGuard(st)
    guard.snapshot()
    st.resize_history(5)
    st.amax_history[:, 0] = float("nan")
    st.scale.fill_(float("nan"))
    st.update_step.add_(1)
    guard.check(torch.tensor(float("inf")), None)
    guard.restore_if_found()
    for key in _FP8_BUFFERS:
        assert torch.equal(getattr(st, key), getattr(reference, key)), key


def test_restore_before_snapshot_raises():
    with pytest.raises(RuntimeError, match="snapshot"):
        NonFiniteGuard(_model()).restore_if_found()


def _replica(rank, world_size, tmp):
    """One of two gloo data-parallel replicas (no DDP: each keeps its own gradients): rank 1's input is NaN, so
    only rank 1's loss and gradient norm are non-finite. Writes (found_inf, weights unchanged) to tmp/rank<r>.json."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(model, group=dist.group.WORLD)
    before = copy.deepcopy(model.state_dict())
    guard.snapshot()
    x = torch.randn(5, 4) * (float("nan") if rank == 1 else 1.0)
    loss = model(x).square().mean()
    loss.backward()
    guard.check(loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    guard.optimizer_step(opt)
    guard.restore_if_found()
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps([float(guard.found_inf), unchanged]))


def test_replicas_agree_to_skip(tmp_path):
    """A non-finite step on one data-parallel replica is skipped by both (found_inf MAX-reduced over the group):
    rank 0, whose own loss is finite, leaves its weights too. Ranks run by the shared multi-rank harness (spawned
    processes, a TCP rendezvous store held by this process, a barrier before teardown: a file rendezvous here once
    aborted a rank at exit in a full CPU run)."""
    run_ranks(_replica, 2, str(tmp_path))
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[1.0, True], [1.0, True]]
