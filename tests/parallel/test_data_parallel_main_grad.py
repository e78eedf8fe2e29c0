"""GradientAverager (fp8engine.parallel.data_parallel) on parameters whose gradient is ``main_grad``: layers built
with ``fuse_wgrad_accumulation=True`` and FP8 primary weights (``fp8_model_init``) write their weight gradient into
an fp32 ``param.main_grad`` and leave ``.grad`` None; the averager must average ``main_grad`` (in place, the same
tensor object) besides the ordinary ``.grad`` of the other parameters, and refuse a parameter holding both.

Two gloo ranks, each fed different data. Exactness: on gloo the averager divides each rank's bucket by 2 and sums
the two halves, so rank r's result is ``g0 / 2 + g1 / 2``: halving is exact in binary floating point (no value here
is subnormal) and the two-term sum is one correctly rounded addition, commutative, so the same expression evaluated
by hand (``0 + g0 / 2 + g1 / 2``, exact first addition) gives the same bits in fp32 and in bf16. Hence
``rtol=0, atol=0`` throughout.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8engine
from _parallel_harness import run_ranks
from fp8engine.models import GPT, GPTConfig
from fp8engine.modules import Linear
from fp8engine.parallel.data_parallel import GradientAverager
from fp8engine.training.master_weights import FP8MasterWeights

EXACT = dict(rtol=0, atol=0)


class _Net(torch.nn.Module):
    """Two fused-wgrad Linear layers (weights: fp32 ``main_grad``; biases: ``.grad``), a plain parameter, and one
    parameter the forward never uses."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Parameter(torch.randn(24, dtype=dtype))
        self.unused = torch.nn.Parameter(torch.randn(5, dtype=dtype))
        self.fc1 = Linear(24, 40, fuse_wgrad_accumulation=True, params_dtype=dtype)
        self.fc2 = Linear(40, 24, fuse_wgrad_accumulation=True, params_dtype=dtype)
        for w in self.fused():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)

    def fused(self):
        return [self.fc1.weight, self.fc2.weight]

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) * self.scale


def _batch(rank: int, micro: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(7, 24, generator=torch.Generator().manual_seed(100 * rank + micro)).to(dtype)


def _zero(model) -> None:
    model.zero_grad(set_to_none=True)
    for w in model.fused():
        w.main_grad.zero_()


def _gradient(p) -> torch.Tensor:
    """What the averager must average: ``main_grad`` where the parameter has one, else ``.grad`` (zeros if None)."""
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
    return g.clone()


def _local(model, batches, dtype) -> list:
    """This process's gradients of ``model`` over ``batches`` (accumulated), without any averaging."""
    _zero(model)
    for x in batches:
        model(x).float().square().mean().backward()
    return [_gradient(p) for p in model.parameters()]


def _mean(per_rank: list) -> list:
    world = len(per_rank)
    return [sum(g[i] / world for g in per_rank) for i in range(len(per_rank[0]))]


def _check_fused(rank, world_size, dtype, micro_batches):
    model = _Net(dtype)
    fused = {id(w) for w in model.fused()}
    names = [n for n, _ in model.named_parameters()]
    want = _mean([_local(model, [_batch(r, m, dtype) for m in range(micro_batches)], dtype)
                  for r in range(world_size)])
    main_grads = [w.main_grad for w in model.fused()]
    # 0.002 MiB buckets: each fused weight (40 x 24 fp32 main_grad, 3840 bytes) is a bucket of its own
    averager = GradientAverager(model.parameters(), dist.group.WORLD, bucket_mb=0.002)
    assert len(averager.buckets) >= 3
    for step in range(2):  # twice: the averager resets between steps, main_grad is zeroed in place
        _zero(model)
        for m in range(micro_batches):
            last = m == micro_batches - 1
            with contextlib.nullcontext() if last else averager.no_sync():
                model(_batch(rank, m, dtype)).float().square().mean().backward()
            if not last:  # inside no_sync: nothing launched, main_grad holds this rank's own sum so far
                assert averager._pending == []
                own = dict(zip(names, _local(_Net(dtype), [_batch(rank, i, dtype) for i in range(m + 1)], dtype)))
                for name, w in (("fc1.weight", model.fc1.weight), ("fc2.weight", model.fc2.weight)):
                    torch.testing.assert_close(w.main_grad, own[name], **EXACT)
        # every bucket but the unused parameter's was launched by the gradient hooks during the backward,
        # the main_grad buckets included
        assert len(averager._pending) == len(averager.buckets) - 1
        averager.finish()
        for i, (p, w) in enumerate(zip(model.parameters(), want)):
            if id(p) in fused:
                torch.testing.assert_close(p.main_grad, w, **EXACT, msg=f"step {step} main_grad {i}")
                assert p.grad is None, f"step {step} parameter {i}: a fused weight must keep .grad None"
            else:
                torch.testing.assert_close(p.grad, w, **EXACT, msg=f"step {step} parameter {i}")
        # main_grad is still the tensor the user allocated (modules and optimizers hold it)
        assert all(w.main_grad is g for w, g in zip(model.fused(), main_grads))
    averager.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_main_grad_is_averaged(dtype):
    """(1) fuse_wgrad_accumulation layers: main_grad (fp32, also beside bf16 parameters and their bf16 .grad)
    and the plain parameters' .grad are the replicas' mean after finish()."""
    run_ranks(_check_fused, 2, dtype, 1)


def test_no_sync_accumulates_main_grad_then_averages_once():
    """(3) two micro-batches, the first inside no_sync: main_grad accumulates this rank's micro-batches, then the
    step's sum is averaged once."""
    run_ranks(_check_fused, 2, torch.float32, 2)


_GPT = GPTConfig(n_layer=1, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=16, vocab_size=128)


def _gather(t: torch.Tensor, world_size: int) -> list:
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t.contiguous())
    return out


def _check_fp8_primary(rank, world_size, recipe):
    torch.manual_seed(0)
    with fp8engine.fp8_model_init(recipe=recipe):
        model = GPT(_GPT)
    fp8 = [p for p in model.parameters() if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert len(fp8) == 4  # qkv, proj, fc1, fc2
    # built before the optimizer allocates the FP8 weights' main_grad: their buckets are fp32 all the same
    averager = GradientAverager(model.parameters(), dist.group.WORLD, bucket_mb=0.01)
    optimizer = FP8MasterWeights(model, torch.optim.SGD, lr=0.5)  # allocates each FP8 weight's fp32 main_grad
    main_grads = [p.main_grad for p in fp8]
    gen = torch.Generator().manual_seed(7 + rank)  # different tokens on each rank
    tokens = torch.randint(0, _GPT.vocab_size, (2, _GPT.max_seq_len), generator=gen)
    for step in range(2):
        optimizer.zero_grad()
        with fp8engine.fp8_autocast(fp8_recipe=recipe):
            loss = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        # before finish(): every gradient is still this rank's own (the buckets were copied when launched)
        own = [_gradient(p) for p in model.parameters()]
        averager.finish()
        for i, (p, g) in enumerate(zip(model.parameters(), own)):
            ranks = _gather(g, world_size)
            if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                assert not torch.equal(ranks[0], ranks[1])  # different data: the average is not trivial
                assert p.grad is None
                torch.testing.assert_close(p.main_grad, sum(r / world_size for r in ranks), **EXACT,
                                           msg=f"step {step} FP8 weight {i}")
            else:
                torch.testing.assert_close(p.grad, sum(r / world_size for r in ranks), **EXACT,
                                           msg=f"step {step} parameter {i}")
        assert all(p.main_grad is g for p, g in zip(fp8, main_grads))
        optimizer.step()
        # same averaged gradients on every rank: the replicas' FP8 bytes and scales stay identical
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("scale_inv") or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                bits = t.detach().view(torch.uint8) if t.element_size() == 1 else t.detach()
                a, b = _gather(bits, world_size)
                assert torch.equal(a, b), f"step {step}: {name} differs between the replicas"
    averager.remove()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_primary_weights_main_grad_is_averaged(recipe):
    """(2) a GPT built under fp8_model_init, run under fp8_autocast: the FP8 weights' main_grad is the mean of the
    ranks' own main_grads (gathered by hand), the embeddings' and norms' .grad too, and the replicas stay equal
    after FP8MasterWeights' step."""
    recipes = {"delayed": fp8engine.DelayedScaling(), "current": fp8engine.Float8CurrentScaling()}
    run_ranks(_check_fp8_primary, 2, recipes[recipe])


def _check_errors(rank, world_size):
    group = dist.group.WORLD
    x = _batch(rank, 0)

    # a parameter whose module writes .grad (torch.nn.Linear) and that also has a main_grad: ambiguous, refused in
    # the backward's gradient hook (also inside no_sync)
    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 8)
    plain.weight.main_grad = torch.zeros(8, 24)
    averager = GradientAverager(plain.parameters(), group)
    for sync in (averager.no_sync, contextlib.nullcontext):
        plain.zero_grad(set_to_none=True)
        with sync(), pytest.raises(ValueError, match=r"both \.grad and \.main_grad"):
            plain(x).sum().backward()
    averager.remove()

    # a fused weight given a .grad after its backward: refused by finish()
    model = _Net()
    averager = GradientAverager(model.parameters(), group, bucket_mb=0.002)
    model(x).square().mean().backward()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    with pytest.raises(ValueError, match=r"both \.grad and \.main_grad"):
        averager.finish()
    averager.remove()

    # .grad that IS main_grad (the same memory, e.g. after param.grad = param.main_grad): not ambiguous
    model = _Net()
    for w in model.fused():
        w.grad = w.main_grad
    averager = GradientAverager(model.parameters(), group, bucket_mb=0.002)
    model(x).square().mean().backward()
    own = [w.main_grad.clone() for w in model.fused()]
    averager.finish()
    for w, g in zip(model.fused(), own):
        ranks = _gather(g, world_size)
        torch.testing.assert_close(w.main_grad, sum(r / world_size for r in ranks), **EXACT)
        assert w.grad.data_ptr() == w.main_grad.data_ptr()
    averager.remove()

    # a malformed main_grad (not float32, or not the parameter's shape)
    for bad in (torch.zeros(8, 24, dtype=torch.bfloat16), torch.zeros(24, 8), "zeros"):
        p = torch.nn.Parameter(torch.zeros(8, 24))
        p.main_grad = bad
        with pytest.raises(ValueError, match="main_grad"):
            GradientAverager([p], group)

    # an FP8 primary weight without main_grad has no gradient to average
    with fp8engine.fp8_model_init():
        fp8_linear = Linear(16, 16)
    averager = GradientAverager(fp8_linear.parameters(), group)
    with pytest.raises(ValueError, match="FP8 parameter .* has no main_grad"):
        averager.finish()
    averager.remove()

    # a bf16 parameter that gets an fp32 main_grad after the averager was built (its bucket averages bf16)
    p = torch.nn.Parameter(torch.zeros(8, 24, dtype=torch.bfloat16))
    averager = GradientAverager([p], group)
    p.main_grad = torch.zeros(8, 24)
    with pytest.raises(ValueError, match="bucket"):
        averager.finish()
    averager.remove()


def test_gradient_averager_refuses_ambiguous_main_grad():
    """(4) the errors: a parameter with both .grad and main_grad (in the hook and in finish), a malformed main_grad,
    an FP8 parameter without main_grad, a main_grad whose dtype its bucket cannot hold; .grad aliasing main_grad is
    accepted."""
    run_ranks(_check_errors, 2)
