"""The module path (TransformerLayer / GPT with set_parallel_mode, tp = 2, sequence parallel) under FP8 runs its
tensor-parallel communication inside the linear and MLP ops: the sequence-parallel all-gathers of the QKV and fc1
inputs move FP8 bytes (uint8), and the dgrad reduce-scatters are asynchronous (overlapped with the wgrad GEMMs).
Recorded by wrapping the collectives every gather/reduce of fp8engine.parallel goes through, on 2 gloo ranks; the
results are compared with the unsharded layer / GPT as in test_tp_transformer_layer.py / test_gpt_tp.py."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _parallel_harness import run_ranks, shard, sqnr, tp_gpt_pair, world_group  # noqa: E402

import fp8engine  # noqa: E402
import fp8engine.parallel.utils as putils  # noqa: E402
from fp8engine.models import GPTConfig  # noqa: E402
from fp8engine.modules.layernorm_mlp import LayerNormMLP  # noqa: E402
from fp8engine.modules.transformer import TransformerLayer  # noqa: E402
from fp8engine.parallel import all_reduce_sequence_parallel_grads  # noqa: E402

S, B, H, F, HEADS = 8, 2, 32, 64, 4


def _record_collectives(log: list) -> None:
    """Wrap the all-gather / reduce-scatter bases of fp8engine.parallel.utils and dist.all_reduce (this process
    only: a spawned rank) so every call appends ``(name, dtype, async_op)`` to ``log``."""
    def wrap(name, fn):
        def recorded(*args, **kw):
            log.append((name, args[0].dtype, bool(kw.get("async_op", False))))
            return fn(*args, **kw)
        return recorded

    putils._all_gather_base = wrap("all_gather", putils._all_gather_base)
    putils._reduce_scatter_base = wrap("reduce_scatter", putils._reduce_scatter_base)
    dist.all_reduce = wrap("all_reduce", dist.all_reduce)


def _calls(log, name, dtype=None, async_op=None):
    return [c for c in log if c[0] == name and (dtype is None or c[1] == dtype)
            and (async_op is None or c[2] == async_op)]


def _layer_worker(rank, ws, recipe_name):
    g = world_group()
    recipe = fp8engine.DelayedScaling() if recipe_name == "delayed" else fp8engine.CurrentScaling()
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    torch.manual_seed(0)
    ref = TransformerLayer(H, F, HEADS, **kw)
    tp = TransformerLayer(H, F, HEADS, set_parallel_mode=True, tp_group=g, sequence_parallel=True, **kw)
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in tp.named_parameters():
            d = [i for i in range(p.dim()) if p.shape[i] != full[name].shape[i]]
            p.copy_(shard(full[name], d[0], rank, ws) if d else full[name])
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_(True)
    with fp8engine.autocast(recipe=recipe):
        yr = ref(xr)
    yr.backward(dy)

    log = []
    xt = shard(x, 0, rank, ws).clone().requires_grad_(True)
    _record_collectives(log)
    with fp8engine.autocast(recipe=recipe):
        yt = tp(xt)
    n_fwd = len(log)
    yt.backward(shard(dy, 0, rank, ws))
    fwd, bwd = log[:n_fwd], log[n_fwd:]
    # forward: the QKV and fc1 inputs are all-gathered as FP8 bytes, nothing in high precision
    assert len(_calls(fwd, "all_gather", torch.uint8)) == 2, fwd
    assert _calls(fwd, "all_gather", torch.float32) == [], fwd
    # the row-parallel proj and fc2 outputs are reduce-scattered (inside the ops)
    assert len(_calls(fwd, "reduce_scatter", torch.float32)) == 2, fwd
    # backward: the QKV and fc1 dgrads are reduce-scattered asynchronously (overlapped with wgrad), and their FP8
    # input shards re-gathered asynchronously (overlapped with dgrad); the proj / fc2 output gradients gathered
    assert len(_calls(bwd, "reduce_scatter", torch.float32, async_op=True)) == 2, bwd
    assert _calls(bwd, "reduce_scatter", async_op=False) == [], bwd
    assert len(_calls(bwd, "all_gather", torch.uint8, async_op=True)) == 2, bwd
    assert len(_calls(bwd, "all_gather", torch.float32)) == 2, bwd

    all_reduce_sequence_parallel_grads(tp, g)
    assert sqnr(shard(yr, 0, rank, ws), yt) >= 18
    assert sqnr(shard(xr.grad, 0, rank, ws), xt.grad) >= 18
    for name, p in tp.named_parameters():
        d = [i for i in range(p.dim()) if p.shape[i] != full[name].shape[i]]
        want = shard(full[name].grad, d[0], rank, ws) if d else full[name].grad
        assert sqnr(want, p.grad) >= 18, name


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_transformer_layer_sp_fp8_comm_in_the_ops(recipe_name):
    run_ranks(_layer_worker, 2, recipe_name)


def _mlp_worker(rank, ws, sp):
    """The fused and the unfused FP8 MLP give the same bits on CPU; with tensor parallelism too."""
    g = world_group()
    outs = []
    for fused in (True, False):
        torch.manual_seed(0)
        mlp = LayerNormMLP(H, F, tp_group=g, set_parallel_mode=True, sequence_parallel=sp, fused=fused)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
        x = (shard(x, 0, rank, ws) if sp else x).clone().requires_grad_(True)
        for _ in range(2):  # delayed scaling: the second step uses the recorded amaxes
            for p in mlp.parameters():
                p.grad = None
            x.grad = None
            with fp8engine.autocast(recipe=fp8engine.DelayedScaling()):
                y = mlp(x)
            y.backward(torch.ones_like(y))
        outs.append([y.detach(), x.grad] + [p.grad for p in mlp.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # biases: fp32 sums in another order


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_layernorm_mlp_tp_fused_matches_unfused(sp):
    run_ranks(_mlp_worker, 2, sp)


CONFIG = GPTConfig(n_layer=2, n_head=4, hidden_size=64, ffn_hidden_size=128, max_seq_len=16, vocab_size=96)


def _gpt_worker(rank, ws):
    ref, tp, x, y = tp_gpt_pair(CONFIG, sequence_parallel=True)
    recipe = fp8engine.CurrentScaling()
    with fp8engine.autocast(recipe=recipe):
        ref_loss = ref(x, y)
    ref_loss.backward()
    log = []
    _record_collectives(log)
    with fp8engine.autocast(recipe=recipe):
        tp_loss = tp(x, y)
    n_fwd = len(log)
    tp_loss.backward()
    # per layer: QKV and fc1 inputs gathered in FP8; their dgrads reduce-scattered asynchronously
    assert len(_calls(log[:n_fwd], "all_gather", torch.uint8)) == 2 * CONFIG.n_layer
    assert len(_calls(log[n_fwd:], "reduce_scatter", async_op=True)) == 2 * CONFIG.n_layer
    all_reduce_sequence_parallel_grads(tp, world_group())
    assert abs(ref_loss.item() - tp_loss.item()) < 2e-2  # test_gpt_tp.py's tolerance
    assert sqnr(shard(ref.embedding.weight.grad, 0, rank, ws), tp.embedding.weight.grad) >= 18


@pytest.mark.slow
def test_gpt_tp2_sequence_parallel_fp8_comm_in_the_ops():
    run_ranks(_gpt_worker, 2)
