"""GradientAverager (fp8engine.parallel.data_parallel) on real gloo ranks against gradients averaged by hand.

Two ranks: each rank computes both replicas' gradients locally as the reference, so the comparison is exact
((g0 / 2 + g1 / 2) is what the averager sums, and division by 2 is exact in binary floating point).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from _parallel_harness import run_ranks
from fp8engine.parallel.data_parallel import GradientAverager, broadcast_parameters


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24),
                                torch.nn.LayerNorm(24))
    model.unused = torch.nn.Parameter(torch.randn(5))  # never in the forward: its gradient stays None
    return model


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(7, 24, generator=torch.Generator().manual_seed(100 * rank + micro))


def _grads(model, batches) -> list:
    model.zero_grad(set_to_none=True)
    for x in batches:
        model(x).square().mean().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _check_average(rank, world_size, micro_batches):
    model = _model()
    reference = [_grads(model, [_batch(r, m) for m in range(micro_batches)]) for r in range(world_size)]
    want = [sum(g[i] / world_size for g in reference) for i in range(len(reference[0]))]
    model.zero_grad(set_to_none=True)
    # 0.002 MiB buckets: the 6 parameters that get gradients fall in several buckets, launched during the backward
    averager = GradientAverager(model.parameters(), dist.group.WORLD, bucket_mb=0.002)
    assert len(averager.buckets) >= 3
    for step in range(2):  # twice: the averager resets between steps
        model.zero_grad(set_to_none=True)
        for m in range(micro_batches):
            last = m == micro_batches - 1
            with contextlib.nullcontext() if last else averager.no_sync():
                model(_batch(rank, m)).square().mean().backward()
        assert len(averager._pending) == len(averager.buckets) - 1  # all but the unused parameter's, in flight
        averager.finish()
        for i, (p, w) in enumerate(zip(model.parameters(), want)):
            torch.testing.assert_close(p.grad, w, rtol=0, atol=0, msg=f"step {step} parameter {i}")
    averager.remove()
    model.zero_grad(set_to_none=True)
    model(_batch(rank, 0)).square().mean().backward()  # hooks removed: this rank's own gradient, not averaged
    own = dict(zip([n for n, _ in model.named_parameters()], _grads(_model(), [_batch(rank, 0)])))
    torch.testing.assert_close(model[0].weight.grad, own["0.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_gradient_averager_equals_the_replica_mean(micro_batches):
    run_ranks(_check_average, 2, micro_batches)


def _check_broadcast(rank, world_size):
    torch.manual_seed(rank)  # different initialisations
    model = torch.nn.Linear(6, 3)
    model.register_buffer("history", torch.full((4,), float(rank)))
    broadcast_parameters(model, dist.group.WORLD)
    torch.manual_seed(0)
    want = torch.nn.Linear(6, 3)
    torch.testing.assert_close(model.weight, want.weight, rtol=0, atol=0)
    assert torch.equal(model.history, torch.full((4,), float(rank)))  # buffers stay per rank


def test_broadcast_parameters_copies_the_first_rank():
    run_ranks(_check_broadcast, 2)


def test_gradient_averager_errors():
    with pytest.raises(ValueError, match="no parameter requires grad"):
        GradientAverager([torch.nn.Parameter(torch.ones(2), requires_grad=False)], None)
    with pytest.raises(ValueError, match="bucket_mb"):
        GradientAverager([torch.nn.Parameter(torch.ones(2))], None, bucket_mb=0)
