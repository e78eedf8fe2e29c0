"""fp8engine.parallel.fsdp on 2 gloo ranks: FSDP2 over a GPT in FP8 against the unsharded model, the sharded
gradient norm and clipping against torch's on the full gradients, parameter marks kept through sharding."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _parallel_harness import run_ranks
import fp8engine
from fp8engine.models import GPT, GPTConfig
from fp8engine.parallel.fsdp import is_sharded, local_tensor, shard_model
from fp8engine.training.distributed import clip_grad_norm

_CONFIG = GPTConfig(n_layer=2, n_head=4, hidden_size=64, ffn_hidden_size=256, max_seq_len=32, vocab_size=128)


def _step(model, tokens, recipe, group=None):
    with fp8engine.fp8_autocast(True, recipe, fp8_group=group):
        loss = model(tokens, tokens.roll(-1, 1))
    loss.backward()
    return loss.detach()


def _check(rank, world_size, recipe_name):
    recipe = {"delayed": fp8engine.DelayedScaling(), "current": fp8engine.CurrentScaling()}[recipe_name]
    references = []
    for _ in range(world_size):  # one unsharded model per half-batch: each starts from the initial FP8 state
        torch.manual_seed(0)
        references.append(GPT(_CONFIG))
    reference = references[0]
    torch.manual_seed(0)
    model = GPT(_CONFIG)
    model.layers[0].self_attention.proj.weight.mark = "kept"
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers)
    assert is_sharded(model.layers[0].self_attention.proj.weight)
    assert model.layers[0].self_attention.proj.weight.mark == "kept"  # attributes survive fully_shard
    tokens = torch.randint(0, 128, (2 * world_size, 32), generator=torch.Generator().manual_seed(5))
    mine = tokens.chunk(world_size)[rank]
    loss = _step(model, mine, recipe, dist.group.WORLD)
    # the reference: each rank's half of the batch in one process, gradients averaged (what FSDP reduce-scatters)
    losses = [_step(ref, half, recipe) for ref, half in zip(references, tokens.chunk(world_size))]
    torch.testing.assert_close(loss, losses[rank], rtol=0, atol=0)  # same weights, same FP8 math on this half
    grads = [dict((n, p.grad) for n, p in ref.named_parameters()) for ref in references]
    full = {n: sum(g[n] for g in grads) / world_size for n in grads[0]}  # the replicas' average
    for name, p in model.named_parameters():
        got = p.grad.full_tensor()
        # fp32 sums of two halves' gradients in another order: a few ulps
        torch.testing.assert_close(got, full[name], rtol=1e-5, atol=1e-7, msg=name)
    norm = clip_grad_norm(list(model.parameters()), 0.5, None, dist.group.WORLD)
    for n, p in reference.named_parameters():
        p.grad = full[n]
    want = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
    torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), dict(reference.named_parameters())[name].grad, rtol=1e-5,
                                   atol=1e-7, msg=name)
    assert local_tensor(p.grad).numel() <= -(-p.shape[0] // world_size) * p[0].numel()  # this rank's shard only


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fsdp_gpt_matches_the_unsharded_model(recipe):
    run_ranks(_check, 2, recipe)


def _check_fp8_all_gather(rank, world_size, recipe_name):
    """The FP8 all-gather's bytes equal the cast of the unsharded weight with the same scale, bit for bit; the
    shard's amax travels with them; the unsharded parameter the module computes with is a GatheredFP8Weight of
    those bits (its values: the bits dequantized), and under delayed scaling the module records the whole weight's
    true amax."""
    from fp8engine.fp8.dtypes import fp8_max_of
    from fp8engine.fp8.float8_tensor import current_scale
    from fp8engine.modules.linear import Linear
    from fp8engine.fp8.gathered_weight import GatheredFP8Weight
    from fp8engine.parallel.fsdp_fp8 import FP8AllGatherWeight, fp8_weight_rows

    recipe = {"delayed": fp8engine.DelayedScaling(), "current": fp8engine.CurrentScaling()}[recipe_name]
    torch.manual_seed(0)
    layer = Linear(32, 64)
    (module, name, state, row), = fp8_weight_rows(layer)
    assert (module, name) == (layer, "weight")
    state.scale[row] = 37.5  # a delayed-scaling scale that is not a power of two
    full = layer.weight.detach().clone()
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(layer, mesh, [], fp8_all_gather=True)
    local = layer.weight._local_tensor
    assert isinstance(local, FP8AllGatherWeight)
    with fp8engine.fp8_autocast(True, recipe, fp8_group=dist.group.WORLD):
        (q, amax_bytes), (scale_inv, dtype, _) = local.fsdp_pre_all_gather(mesh, None, None, None, None)
        assert q.dtype == torch.uint8 and q.element_size() == 1  # half of bf16's bytes
        assert torch.equal(amax_bytes.view(torch.float32), full.chunk(world_size)[rank].abs().amax().reshape(1))
        gathered = torch.empty(world_size * q.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(gathered, q.reshape(-1))
        scale = (state.scale[row:row + 1].clone() if recipe_name == "delayed"  # (the exit updates the state)
                 else current_scale(full.abs().amax(), dtype))
        want = (full * scale).clamp(-fp8_max_of(dtype), fp8_max_of(dtype)).to(dtype)
        assert torch.equal(gathered.view(dtype).view(64, 32).view(torch.uint8), want.view(torch.uint8))
        seen = {}
        # (read while gathered: FSDP2 frees the unsharded storage after the forward)
        layer.register_forward_pre_hook(lambda m, args: seen.update(
            kind=type(m.weight), bits=m.weight._data.view(torch.uint8).clone(), values=m.weight.detach().clone()))
        state.amax_history.zero_()
        layer(torch.randn(8, 32))
        assert issubclass(seen["kind"], GatheredFP8Weight), seen["kind"]
        assert torch.equal(seen["bits"], want.view(torch.uint8))  # the bits the GEMM takes
        if recipe_name == "delayed":  # the whole weight's amax, exact (not the max of its FP8 values)
            assert state.amax_history[row, 0] == full.abs().amax()
    torch.testing.assert_close(seen["values"], want.float() * scale.reciprocal(), rtol=0, atol=0)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_all_gather_equals_cast_then_gather(recipe):
    run_ranks(_check_fp8_all_gather, 2, recipe)


def _check_backward_regather(rank, world_size, recipe_name):
    """With ``reshard_after_forward`` the backward all-gathers every layer again. Between the two gathers the
    autocast exit updates the delayed-scaling scales: the re-gather must still give the forward's values bit for bit
    (autograd saved the parameter in the forward), so it uses the forward's scale, not the updated one."""
    from fp8engine.parallel.fsdp_fp8 import FP8AllGatherWeight

    recipe = {"delayed": fp8engine.DelayedScaling(), "current": fp8engine.CurrentScaling()}[recipe_name]
    torch.manual_seed(0)
    model = GPT(_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers, fp8_all_gather=True, reshard_after_forward=True)
    target = model.layers[0].self_attention.proj.weight._local_tensor
    seen = []  # (in backward, gathered values) of the target weight, every gather
    original = FP8AllGatherWeight.fsdp_post_all_gather

    def recording(self, outputs, metadata, param_dtype, *, out=None):
        result = original(self, outputs, metadata, param_dtype, out=out)
        if self is target:
            full = out if out is not None else result[0]
            seen.append((torch._C._current_graph_task_id() != -1, full.detach().clone()))
        return result

    FP8AllGatherWeight.fsdp_post_all_gather = recording
    try:
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            scale_before = model.layers[0].self_attention.proj.fp8_state.scale.clone()
            _step(model, tokens, recipe, dist.group.WORLD)
            if recipe_name == "delayed":  # the update between the gathers moved the scale (else the test is void)
                assert not torch.equal(model.layers[0].self_attention.proj.fp8_state.scale, scale_before)
    finally:
        FP8AllGatherWeight.fsdp_post_all_gather = original
    assert [backward for backward, _ in seen] == [False, True, False, True]  # one forward and one backward gather
    for step in range(2):
        assert torch.equal(seen[2 * step][1], seen[2 * step + 1][1]), f"step {step}: re-gather differs"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_backward_regather_gives_the_forward_values(recipe):
    run_ranks(_check_backward_regather, 2, recipe)


def _check_gathered_bytes(rank, world_size):
    from fp8engine.bench.comm import fsdp_gather_bytes
    from fp8engine.parallel.fsdp_fp8 import fp8_weight_rows

    bf16, _ = fsdp_gather_bytes(_CONFIG, False, torch.device("cpu"))
    fp8, _ = fsdp_gather_bytes(_CONFIG, True, torch.device("cpu"))
    model = GPT(_CONFIG)
    fp8_ids = {id(getattr(module, name)) for module, name, _, _ in fp8_weight_rows(model)}
    # every parameter is gathered whole once per forward (no padding: every dim 0 divides by 2): 2 bytes per element
    # in bf16, 1 byte for the FP8 GEMM weights with --fp8-all-gather, and each shard's fp32 amax (4 bytes per rank)
    numel = {id(p): p.numel() for p in model.parameters()}
    assert bf16 == 2 * sum(numel.values())
    assert fp8 == sum(n + 4 * world_size if i in fp8_ids else 2 * n for i, n in numel.items())
    assert 0.5 < fp8 / bf16 < 0.6  # the GEMM weights are most of the bytes; embedding, norms, biases stay bf16


def test_fp8_all_gather_moves_one_byte_per_gemm_weight_element():
    """``python -m fp8engine.bench comm --fsdp-model``'s count on 2 gloo ranks: the bytes FSDP2 all-gathers in one
    forward are exactly the dtype arithmetic (about 0.55x with the FP8 all-gather for this GPT; 0.540x for 1b)."""
    run_ranks(_check_gathered_bytes, 2)


def _check_current_scales_batched(rank, world_size):
    """Current scaling with the FP8 all-gather: from the second forward on, one amax all-reduce for all the weights
    (CurrentScales' round) instead of one per weight, and the gathered weights equal the cast of the whole weight
    with ``fp8_max / max |W|`` bit for bit (the per-weight rule), also after an optimizer step changed them."""
    from fp8engine.fp8.dtypes import fp8_max_of
    from fp8engine.fp8.float8_tensor import current_scale
    from fp8engine.parallel.fsdp_fp8 import FP8AllGatherWeight, fp8_weight_rows

    torch.manual_seed(0)
    model = GPT(_CONFIG)
    n_weights = len(fp8_weight_rows(model))
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers, fp8_all_gather=True, reshard_after_forward=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen, reduces = [], []
    original_post, original_reduce = FP8AllGatherWeight.fsdp_post_all_gather, dist.all_reduce

    def recording(self, outputs, metadata, param_dtype, *, out=None):
        result = original_post(self, outputs, metadata, param_dtype, out=out)
        seen.append((self, (out if out is not None else result[0]).detach().clone()))
        return result

    def counting(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        return original_reduce(tensor, *args, **kwargs)

    FP8AllGatherWeight.fsdp_post_all_gather, dist.all_reduce = recording, counting
    try:
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(rank))
        for step in range(3):
            seen.clear()
            reduces.clear()
            with fp8engine.fp8_autocast(True, fp8engine.CurrentScaling(), fp8_group=dist.group.WORLD):
                loss = model(tokens, tokens.roll(-1, 1))
            amax_reduces = [n for n in reduces if n > 1 or n_weights == 1]
            if step > 0:  # one round of n_weights amaxes (the first forward registers the weights one by one)
                assert amax_reduces == [n_weights], reduces
            assert len(seen) == n_weights
            for wrapper, gathered in seen:
                full = torch.cat([torch.empty_like(wrapper._data)] * world_size)
                dist.all_gather_into_tensor(full, wrapper._data.detach())
                dtype = torch.float8_e4m3fn
                scale = current_scale(full.abs().amax(), dtype)
                want = (full * scale).clamp(-fp8_max_of(dtype), fp8_max_of(dtype)).to(dtype).float() * scale.reciprocal()
                torch.testing.assert_close(gathered, want.view(gathered.shape), rtol=0, atol=0, msg=f"step {step}")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        FP8AllGatherWeight.fsdp_post_all_gather, dist.all_reduce = original_post, original_reduce


def test_current_scaling_all_gather_reduces_all_amaxes_at_once():
    run_ranks(_check_current_scales_batched, 2)


def _check_fsdp_optimizer(rank, world_size):
    """``make_optimizer`` for a CUDA run of FSDP2-sharded parameters: the fused AdamW with a float learning rate
    (its tensor-learning-rate overload has no fake kernel, which DTensor needs to derive its outputs' metadata: the
    first step then ran on real copies of every shard and state). The fused kernel also runs on CPU tensors, so
    the optimizer this returns takes a real step here, and ``set_lr`` sets its float learning rate."""
    from fp8engine.training.step import make_optimizer, set_lr

    torch.manual_seed(0)
    model = GPT(_CONFIG)
    shard_model(model, init_device_mesh("cpu", (world_size,)), model.layers)
    optimizer = make_optimizer(model, 1e-3, 0.1, torch.device("cuda"))
    assert optimizer.defaults["fused"] and all(isinstance(g["lr"], float) for g in optimizer.param_groups)
    before = [p.detach().full_tensor() for p in model.parameters()]
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(tokens, tokens.roll(-1, 1)).backward()
    optimizer.param_groups[0]["lr"] = torch.tensor(1e-3)  # as a checkpoint of a tensor learning rate loads it
    set_lr(optimizer, 2e-3)
    optimizer.step()
    assert all(type(g["lr"]) is float and g["lr"] == 2e-3 for g in optimizer.param_groups)
    assert any(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))


def test_fsdp_optimizer_has_a_float_learning_rate():
    run_ranks(_check_fsdp_optimizer, 2)


def _check_fp8_model_init(rank, world_size, preserve, recipe_name):
    """A GPT built under ``fp8_model_init`` shards: each FP8 primary weight becomes its fp32 master (the kept
    initial value, else its FP8 bytes dequantized), all-gathered as FP8 bytes; the run then equals, loss for loss
    and bit for bit, FSDP2 with the FP8 all-gather over a plainly built GPT whose weights hold the same masters."""
    from fp8engine.modules.base import FP8Module
    from fp8engine.parallel.fsdp_fp8 import FP8AllGatherWeight

    torch.manual_seed(0)
    with fp8engine.fp8_model_init(preserve_high_precision_init_val=preserve):
        model = GPT(_CONFIG)
    masters = {}
    for mname, module in model.named_modules():
        for name in module.fp8_primary_weights() if isinstance(module, FP8Module) else ():
            weight = getattr(module, name)
            init = weight.get_high_precision_init_val() if preserve else None
            masters[f"{mname}.{name}"] = (init if init is not None
                                          else weight.float() * getattr(module, name + "_scale_inv")).clone()
    assert len(masters) == 4 * _CONFIG.n_layer  # qkv, proj, fc1, fc2 per layer
    torch.manual_seed(0)
    plain = GPT(_CONFIG)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name in masters:
                if preserve:  # the kept initial value is the plain model's own initialisation
                    assert torch.equal(p, masters[name]), name
                p.copy_(masters[name])
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers)  # no fp8_all_gather=True: FP8 primary weights switch it on
    shard_model(plain, mesh, plain.layers, fp8_all_gather=True)
    assert not any(n.endswith("_scale_inv") for n, _ in model.named_buffers())
    for name, p in model.named_parameters():
        if name in masters:
            assert p.dtype == torch.float32 and isinstance(p._local_tensor, FP8AllGatherWeight), name
            assert torch.equal(p.full_tensor(), masters[name]), name
    recipe = {"delayed": fp8engine.DelayedScaling(), "current": fp8engine.CurrentScaling()}[recipe_name]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    for step in range(3):
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        losses = []
        for m, opt in zip((model, plain), optimizers):
            losses.append(_step(m, tokens, recipe, dist.group.WORLD))
            opt.step()
            opt.zero_grad()
        assert torch.equal(losses[0], losses[1]), (step, losses)  # the same masters, casts and bytes
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name


@pytest.mark.parametrize("preserve,recipe", [(True, "delayed"), (False, "delayed"), (True, "current")],
                         ids=["kept-init-delayed", "dequantized-delayed", "kept-init-current"])
def test_fp8_model_init_shards_with_masters_and_fp8_all_gather(preserve, recipe):
    run_ranks(_check_fp8_model_init, 2, preserve, recipe)


def _layout(rank, world_size, mesh):
    from fp8engine.training.distributed import Layout

    return Layout(rank, world_size, rank, world_size, 1, 0, dist.group.WORLD, None, mesh)


def _save_to_reshard(rank, world_size, out):
    """One FP8 step and one more backward (its gradient amaxes wait in column 0 of each rank's histories, not yet
    MAX-reduced), a checkpoint, and what it holds: full parameters and AdamW moments, each rank's buffers."""
    from fp8engine.training.checkpoint import capture_rng_state
    from fp8engine.training.sharded_checkpoint import save_sharded

    torch.manual_seed(0)
    model = GPT(_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(rank))
    _step(model, tokens, fp8engine.DelayedScaling(), dist.group.WORLD)
    opt.step()
    _step(model, tokens.flip(1), fp8engine.DelayedScaling(), dist.group.WORLD)
    save_sharded(out, _layout(rank, world_size, mesh), model, opt,
                 {"rng": capture_rng_state(), "step": 1, "settings": {"world_size": world_size}}, 1)
    full = {n: (p.full_tensor(), opt.state[p]["exp_avg"].full_tensor(), opt.state[p]["exp_avg_sq"].full_tensor())
            for n, p in model.named_parameters()}  # (full_tensor is collective: every rank)
    torch.save({"full": full, "buffers": dict(model.named_buffers())}, out / f"want{rank}.pt")


def _load_resharded(rank, world_size, out, saved_world_size):
    """The checkpoint of ``saved_world_size`` ranks loaded into ``world_size``: the same parameters and AdamW moments
    bit for bit (DCP reshards the DTensor shards), every rank's buffers the MAX of the saved ranks' (amax histories:
    the reduction the next autocast exit would have done), no RNG states."""
    from fp8engine.training.sharded_checkpoint import load_sharded

    torch.manual_seed(1)  # other initial values: everything compared below must come from the checkpoint
    model = GPT(_CONFIG)
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, mesh, model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded = load_sharded(out / "checkpoint" / "step_1", _layout(rank, world_size, mesh), model, opt,
                          saved_world_size=saved_world_size)
    assert loaded["rng"] is None
    saved = [torch.load(out / f"want{r}.pt") for r in range(saved_world_size)]
    for name, p in model.named_parameters():
        got = (p.full_tensor(), opt.state[p]["exp_avg"].full_tensor(), opt.state[p]["exp_avg_sq"].full_tensor())
        for g, w in zip(got, saved[0]["full"][name]):
            assert torch.equal(g, w), name
    pending = 0
    for name, b in model.named_buffers():
        want = torch.stack([s["buffers"][name] for s in saved]).amax(0) if b.is_floating_point() \
            else saved[0]["buffers"][name]
        assert torch.equal(b, want), name
        pending += not all(torch.equal(s["buffers"][name], saved[0]["buffers"][name]) for s in saved)
    assert pending  # the saved ranks' histories did differ (their own gradient amaxes): the MAX was needed


@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2)])
def test_fsdp_checkpoint_reshards_onto_another_world_size(tmp_path, saved, loaded):
    run_ranks(_save_to_reshard, saved, tmp_path)
    run_ranks(_load_resharded, loaded, tmp_path, saved)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_layers_per_group_must_be_a_positive_integer(bad):
    class _Mesh:  # the check comes before any use of the mesh
        ndim = 1

    with pytest.raises(ValueError, match="layers_per_group must be a positive integer"):
        shard_model(torch.nn.Linear(2, 2), _Mesh(), [], layers_per_group=bad)
