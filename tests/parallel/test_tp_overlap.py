"""The tensor-parallel overlap (``TPLinearComm.overlap``, Megatron's ``tp_comm_overlap``): sequence-parallel GEMMs
split by rows so this rank's rows run beside the all-gather / reduce-scatter.

On 2 gloo ranks a GPT with the overlap gives the bits of the same GPT without it (at tp = 2 a split GEMM's rows are
the whole GEMM's on CPU, and the reduce-scatter of the other rank's rows plus this rank's rows rounds once, as the
sum of two bf16/fp32 terms in the plain reduce-scatter does): losses and every gradient, FP8 delayed / current and
(a GPT) and fp32 (ColumnParallelLinear -> RowParallelLinear, the high-precision op path), over two steps (the
second uses the amax the first recorded). The forward's row-parallel reduce-scatters are
asynchronous with the overlap and synchronous without; one process checks the order of the split fprop."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _parallel_harness import run_ranks, world_group  # noqa: E402
from test_tp_module_comm import _calls, _record_collectives  # noqa: E402

import fp8engine  # noqa: E402
import fp8engine.ops.comm as comm_mod  # noqa: E402
from fp8engine.models import GPT, GPTConfig  # noqa: E402
from fp8engine.ops.comm import GatherInFlight  # noqa: E402
from fp8engine.parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from fp8engine.parallel.linear_ops import set_tp_comm_overlap  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=16, vocab_size=96)
RECIPES = {"delayed": fp8engine.DelayedScaling, "current": fp8engine.CurrentScaling}


def _run(model, x, y, recipe, log=None):
    losses, counts = [], []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        if log is not None:
            log.clear()
        with fp8engine.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(x, y)
        if log is not None:
            counts.append(len(_calls(log, "reduce_scatter", async_op=True)))
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counts


class _ColumnRow(torch.nn.Module):
    """Megatron's MLP pair: column- then row-parallel, sequence parallel; ``(x, y)`` -> mean squared error."""

    def __init__(self, group):
        super().__init__()
        self.fc1 = ColumnParallelLinear(32, 64, tp_group=group, sequence_parallel=True)
        self.fc2 = RowParallelLinear(64, 32, tp_group=group, sequence_parallel=True, input_is_parallel=True)

    def forward(self, x, y):
        h, _ = self.fc1(x)  # (output, output_bias) as Megatron's layers return
        out, _ = self.fc2(torch.relu(h))
        return torch.nn.functional.mse_loss(out, y)


def _worker(rank, ws, recipe_name):
    recipe = RECIPES[recipe_name]() if recipe_name in RECIPES else None
    models = []
    for overlap in (True, False):
        torch.manual_seed(0)
        if recipe_name == "fp32":
            model, linears = _ColumnRow(world_group()), 2
        else:
            model, linears = GPT(CONFIG, tp_group=world_group(), sequence_parallel=True), 4 * CONFIG.n_layer
        assert set_tp_comm_overlap(model, overlap) == linears  # (GPT: qkv, proj, fc1, fc2 per layer)
        models.append(model)
    gen = torch.Generator().manual_seed(1)
    if recipe_name == "fp32":  # this rank's sequence shard [s/tp, b, h]
        x, y = (torch.randn(8, 3, 32, generator=gen)[rank * 4:(rank + 1) * 4] for _ in range(2))
    else:
        x, y = (torch.randint(0, CONFIG.vocab_size, (3, CONFIG.max_seq_len), generator=gen) for _ in range(2))
    log = []
    _record_collectives(log)
    (loss_on, grads_on, async_on), (loss_off, grads_off, async_off) = (_run(m, x, y, recipe, log) for m in models)
    # forward: the proj and fc2 reduce-scatters started asynchronously (beside this rank's rows' GEMM) only with it
    rows = 1 if recipe_name == "fp32" else 2 * CONFIG.n_layer
    assert async_on == [rows] * 2 and async_off == [0, 0], (async_on, async_off)
    for a, b in zip(loss_on, loss_off):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name in grads_on:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES) + ["fp32"])
def test_gpt_tp2_overlap_equals_no_overlap(recipe_name):
    run_ranks(_worker, 2, recipe_name)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_gather_in_flight_fprop_runs_local_rows_before_waiting(monkeypatch, rank):
    g = torch.Generator().manual_seed(rank)
    total, w = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.randn(5, 8, generator=g,
                                                                                 dtype=torch.float64)
    local = total[rank * 4:(rank + 1) * 4]
    log = []
    real = comm_mod.part_fprop

    def logged(x, *args):
        log.append("gemm local" if x.data_ptr() == local.data_ptr() else "gemm other")
        return real(x, *args)

    monkeypatch.setattr(comm_mod, "part_fprop", logged)
    pending = GatherInFlight(local, total, lambda: log.append("wait"), rank, 3)
    y = pending.fprop(w, torch.float64, None)
    assert log == ["gemm local", "wait"] + ["gemm other"] * (2 if rank == 1 else 1)
    torch.testing.assert_close(y, total @ w.t(), rtol=0, atol=0)
    assert pending.wait() is total and log.count("wait") == 1  # waits once
