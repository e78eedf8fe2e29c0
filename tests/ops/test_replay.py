"""Record once, replay many (``fp8engine.ops.replay``) and the fused FP8 layer step's use of it: a replayed step
runs the recorded ops on the new tensors, so it gives the same bits as the ordinary Python on the same inputs
(exact: the same ops in the same order); and where a recording is not sound, nothing is replayed."""
import copy

import pytest
import torch

import fp8engine
import fp8engine.ops.layer as layer_mod
from fp8engine.fp8.float8_tensor import kernels_forced
from fp8engine.kernels._common import interpreting
from fp8engine.modules import RotaryEmbedding, TransformerLayer
from fp8engine.ops import replay
from tests.ops._ops_test_utils import record, replay_layer_steps, replay_unchecked  # noqa: F401 (autouse fixture)
from tests.conftest import sqnr

H, FFN, HEADS, S, B = 64, 128, 4, 16, 2



# ---------------------------------------------------------------------------------------------------------------
# The recorder and the program on small functions
# ---------------------------------------------------------------------------------------------------------------

def test_program_replays_the_recorded_ops_on_new_inputs():
    def fn(a, b):
        c = a.contiguous()  # a itself: not recorded
        _ = c.shape, c.is_contiguous()  # queries: not recorded
        d = torch.empty(3, 4)
        d.copy_(c * 2)  # written in place: kept
        b.t()  # nothing reads it: dropped
        return d + b, d
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    rec, (y, d) = record(fn, a, b)
    prog = replay.Program(rec, rec.template((y, None, [d])))
    a2, b2 = torch.randn(3, 4), torch.randn(3, 4)
    (y2, none, (d2,)), kept = prog((a2, b2))
    assert torch.equal(y2, a2 * 2 + b2) and torch.equal(d2, a2 * 2) and none is None and kept == []
    assert prog.n_ops == 4, prog.source  # empty, mul, copy_, add: no contiguous / shape / t()
    assert ".t(" not in prog.source and "contiguous" not in prog.source


def test_recording_aborts_on_a_tensor_from_elsewhere():
    other = torch.randn(3)
    rec, out = record(lambda a: a + other, torch.randn(3))
    assert rec.error is not None and "neither an input" in rec.error
    with pytest.raises(replay.RecordAbort):
        replay.Program(rec, rec.template(out))


def test_recording_aborts_on_an_autograd_graph():
    def fn(a):
        with torch.enable_grad():
            leaf = a.detach().requires_grad_()
            return (leaf * 2).detach()
    rec, _ = record(fn, torch.randn(3))
    assert rec.error == "an op inside the step built an autograd graph"


def test_pair_passes_only_what_the_backward_reads():
    x = torch.randn(4)
    fwd, (y, t) = record(lambda a: (a.exp(), a * 3), x)
    # the backward reads y (made in the forward) and its own input
    dy = torch.randn(4)
    bwd = replay.Recorder([dy], outer=fwd)
    with bwd:
        g = dy * y
    pair = replay.Pair(fwd, fwd.template((y,)), bwd, bwd.template((g,)))
    x2, dy2 = torch.randn(4), torch.randn(4)
    (y2,), saved = pair.forward((x2,))
    assert len(saved) == 1 and saved[0] is y2  # t (a * 3) is not kept for the backward
    (g2,) = pair.backward((dy2,), saved)
    assert torch.equal(y2, x2.exp()) and torch.equal(g2, dy2 * x2.exp())
    assert saved == []  # the backward holds the forward's tensors itself, releasing each after its last use


def test_launches_are_replayed_through_the_compiled_launcher_with_current_addresses(monkeypatch):
    """A recorded launch is replayed by calling its compiled launcher (faked here) with the new tensors' addresses;
    a view made only to be launched (``view(torch.uint8)``) is not made again: its source's address is passed."""
    from fp8engine.kernels import _common

    calls = []
    fake_run = lambda *a: calls.append(a)  # noqa: E731 -- (grid x3, stream, function, packed, 3 hooks, args, tail)
    monkeypatch.setattr(_common, "launch_now", lambda kernel, grid, args, meta: None)
    monkeypatch.setattr(_common, "launch_entry", lambda kernel, args, meta: (fake_run, "fn", "packed", (7,)))
    monkeypatch.setattr(_common, "current_stream", lambda: 1234)
    kernel = object()

    def fn(a):
        out = torch.empty(8, dtype=torch.float8_e4m3fn)
        _common.launch(kernel, (2,), a, out.view(torch.uint8), 8, BLOCK=4)
        return out
    a = torch.randn(8)
    rec, out = record(fn, a)
    prog = replay.Program(rec, rec.template(out))
    assert prog.n_ops == 2 and "view" not in prog.source, prog.source  # empty + the launch
    a2 = torch.randn(8)
    out2, _ = prog((a2,))
    assert calls == [(2, 1, 1, 1234, "fn", "packed", None, None, None, a2.data_ptr(), out2.data_ptr(), 8, 7)]


def test_a_chain_of_views_replays_as_one_view_of_its_root():
    """``a.view(...)[:, 1].t()`` whose links nothing else reads replays as one ``as_strided`` of ``a`` (the recorded
    sizes and strides, the storage offset relative to ``a``'s: right for an input at another offset too); a link
    another op reads is kept."""
    def fn(a):
        b = a.view(2, 3, 4)
        d = b[:, 1].t()  # b and b[:, 1]: links only
        e = a.view(6, 4)[2:]
        return d * 2, e + e.sum()  # e: read by two ops, kept; its link a.view(6, 4): collapsed into e
    a = torch.randn(24)
    rec, out = record(fn, a)
    prog = replay.Program(rec, rec.template(out))
    fns = [c for c in prog._consts.values() if callable(c)]
    assert fns.count(torch.as_strided) == 2 and torch.Tensor.view not in fns, prog.source
    assert prog.n_ops == 5, prog.source  # as_strided, mul, as_strided, sum, add
    big = torch.randn(30)
    a2 = big[5:29]  # the same shape and strides at storage offset 5
    (d2, e2), _ = prog((a2,))
    assert torch.equal(d2, a2.view(2, 3, 4)[:, 1].t() * 2)
    ref_e = a2.view(6, 4)[2:]
    assert torch.equal(e2, ref_e + ref_e.sum())


def _copying_launcher(monkeypatch):
    """A fake compiled launcher whose kernel copies ``nbytes`` from its second argument's address to its first's
    (``ctypes.memmove``), recorded and replayed as a real one."""
    import ctypes

    from fp8engine.kernels import _common

    def run(*a):  # (grid x3, stream, function, packed, 3 hooks, dst, src, nbytes)
        ctypes.memmove(a[9], a[10], a[11])
    monkeypatch.setattr(_common, "launch_now", lambda kernel, grid, args, meta: ctypes.memmove(
        args[0].data_ptr(), args[1].data_ptr(), args[2]))
    monkeypatch.setattr(_common, "launch_entry", lambda kernel, args, meta: (run, "fn", "packed", ()))
    monkeypatch.setattr(_common, "current_stream", lambda: 0)
    return lambda dst, src: _common.launch(object(), (1,), dst.view(torch.uint8), src, src.numel() * src.element_size())


def test_a_block_only_launches_write_is_allocated_in_the_layout_of_its_one_view(monkeypatch):
    """``torch.empty`` + launches writing it + one ``.t()`` of it (how a GEMM takes an FP8 operand) replay as one
    ``torch.empty_strided`` in the transposed layout: the same bytes at the same address, one op fewer. A slice of
    a block, or a block a torch op reads too, is left as recorded. (Pooling off: it would take these blocks.)"""
    monkeypatch.setattr(replay, "POOL", False)
    copy_into = _copying_launcher(monkeypatch)

    def fn(a, src):
        out = torch.empty(4, 8)
        copy_into(out, src)  # the launch writes out's bytes row-major
        other = torch.empty(4, 8)
        copy_into(other, src)
        return a + out.t(), other[:2] + other.sum()  # a slice, and a block torch reads: not folded
    a, src = torch.randn(8, 4), torch.arange(32.0)
    rec, out = record(fn, a, src)
    prog = replay.Program(rec, rec.template(out))
    assert prog.source.count("empty_strided") == 0  # (the const's name is in _consts; its repr is)
    fns = [c for c in prog._consts.values() if callable(c)]
    assert torch.empty_strided in fns and fns.count(torch.empty) == 1, prog.source
    assert torch.Tensor.t not in fns, prog.source
    a2, src2 = torch.randn(8, 4), torch.randn(32)
    (y, z), _ = prog((a2, src2))
    ref = src2.view(4, 8)
    assert torch.equal(y, a2 + ref.t()) and torch.equal(z, ref[:2] + ref.sum())


def test_a_saved_block_is_allocated_by_the_forward_in_the_layout_the_backward_reads(monkeypatch):
    """A block the forward's launches write and keeps for the backward, whose one use there is ``.t()``: the forward
    allocates it transposed (``empty_strided``) and the backward reads it without the view op. (Pooling off: it
    would take this block.)"""
    monkeypatch.setattr(replay, "POOL", False)
    copy_into = _copying_launcher(monkeypatch)

    def forward(a, src):
        saved = torch.empty(4, 8)
        copy_into(saved, src)
        return a * 2, saved
    a, src = torch.randn(8, 4), torch.arange(32.0)
    fwd, (y, saved) = record(forward, a, src)
    dy = torch.randn(8, 4)
    bwd = replay.Recorder([dy], outer=fwd)
    with bwd:
        g = dy + saved.t()
    pair = replay.Pair(fwd, fwd.template((y,)), bwd, bwd.template((g,)))
    assert torch.Tensor.t not in pair.bwd._consts.values() and pair.bwd.n_ops == 1, pair.bwd.source
    assert torch.empty_strided in pair.fwd._consts.values(), pair.fwd.source
    a2, src2, dy2 = torch.randn(8, 4), torch.randn(32), torch.randn(8, 4)
    (y2,), kept = pair.forward((a2, src2))
    assert kept[0].shape == (8, 4) and kept[0].stride() == (1, 8)  # saved.t()'s layout, allocated as such
    (g2,) = pair.backward((dy2,), kept)
    assert torch.equal(y2, a2 * 2) and torch.equal(g2, dy2 + src2.view(4, 8).t())


def _pool_bytes(prog) -> list:
    """The sizes of the pools a program allocates (its ``torch.empty`` of uint8 blocks)."""
    return [b[1] for b in prog._pool.blocks]


def test_small_blocks_come_from_one_pool_and_address_only_blocks_are_never_made(monkeypatch):
    """Three blocks: one only launches read and write (never made as a tensor: its address is the pool's plus
    its offset), one a torch op reads (an ``as_strided`` view of the pool), one the program returns (its own
    allocation: an output must not hold the pool). Same results as the ordinary code."""
    copy_into = _copying_launcher(monkeypatch)

    def fn(a, src):
        scratch = torch.empty(32)
        copy_into(scratch, src)  # (address only)
        read = torch.empty(4, 8)
        copy_into(read, scratch)
        out = torch.empty(32)
        copy_into(out, read)
        return a + read.t(), out
    a, src = torch.randn(8, 4), torch.arange(32.0)
    rec, out = record(fn, a, src)
    prog = replay.Program(rec, rec.template(out))
    # scratch and read (allocated transposed: its one view is .t(), _fold_allocation_views)
    assert prog.pooled == 2 and len(_pool_bytes(prog)) == 1, prog.source
    fns = [c for c in prog._consts.values() if callable(c)]
    assert fns.count(torch.empty) == 2 and fns.count(torch.as_strided) == 1, prog.source  # pool + out; read
    assert "_p0 + 256" in prog.source  # read's address: the pool's + 128 bytes rounded up to 256
    a2, src2 = torch.randn(8, 4), torch.randn(32)
    (y, out2), _ = prog((a2, src2))
    assert torch.equal(y, a2 + src2.view(4, 8).t()) and torch.equal(out2, src2)
    assert out2.untyped_storage().nbytes() == 32 * 4  # its own block


@pytest.mark.parametrize("leave", ["slice", "split"])
def test_a_block_whose_view_leaves_the_program_is_not_pooled(monkeypatch, leave):
    """A view of a block returned by the program (a slice, a ``split``) would keep the whole pool alive with it:
    the block keeps its own allocation."""
    copy_into = _copying_launcher(monkeypatch)

    def fn(src):
        buf = torch.empty(32)
        copy_into(buf, src)
        return buf[:16] if leave == "slice" else buf.split(16)
    src = torch.arange(32.0)
    rec, out = record(fn, src)
    prog = replay.Program(rec, rec.template(out))
    assert prog.pooled == 0 and _pool_bytes(prog) == [], prog.source
    src2 = torch.randn(32)
    got, _ = prog((src2,))
    assert torch.equal(got if leave == "slice" else torch.cat(got), src2[:16] if leave == "slice" else src2)


def test_a_pooled_block_the_backward_reads_by_address_passes_as_an_int(monkeypatch):
    """A forward block kept for a backward that reads only its address passes as an int, with the pool it points
    into (held until the backward returns); a kept block the backward reads as a tensor passes as an
    ``as_strided`` view of the pool."""
    copy_into = _copying_launcher(monkeypatch)

    def forward(a, src):
        by_address = torch.empty(32)
        copy_into(by_address, src)
        as_tensor = torch.empty(8, 4)
        copy_into(as_tensor, src)
        return a * 2, by_address, as_tensor
    a, src = torch.randn(8, 4), torch.arange(32.0)
    fwd, (y, by_address, as_tensor) = record(forward, a, src)
    dy = torch.randn(8, 4)
    bwd = replay.Recorder([dy], outer=fwd)
    with bwd:
        tmp = torch.empty(4, 8)
        copy_into(tmp, by_address)
        g = dy + tmp.t() + as_tensor
    pair = replay.Pair(fwd, fwd.template((y,)), bwd, bwd.template((g,)))
    assert len(pair.fwd.int_kept) == 1 and pair.fwd.kept_blocks == 1, pair.fwd.source
    a2, src2, dy2 = torch.randn(8, 4), torch.randn(32), torch.randn(8, 4)
    (y2,), kept = pair.forward((a2, src2))
    types = sorted(type(k).__name__ for k in kept)
    assert types == ["Tensor", "Tensor", "int"], kept  # the view, the pool, the address
    pool = next(k for k in kept if isinstance(k, torch.Tensor) and k.dtype == torch.uint8)
    assert next(k for k in kept if type(k) is int) == pool.data_ptr()
    (g2,) = pair.backward((dy2,), kept)
    assert kept == []
    ref = src2.view(4, 8)
    assert torch.equal(y2, a2 * 2) and torch.equal(g2, dy2 + ref.t() + src2.view(8, 4))


def test_a_large_program_pools_only_its_small_blocks(monkeypatch):
    """Where the poolable blocks add up to more than ``POOL_ALL_BYTES``, only those of at most
    ``POOL_SMALL_BYTES`` are pooled (a large block's lifetime matters for the peak memory)."""
    monkeypatch.setattr(replay, "POOL_ALL_BYTES", 1024)
    monkeypatch.setattr(replay, "POOL_SMALL_BYTES", 64)
    copy_into = _copying_launcher(monkeypatch)

    def fn(src, small_src):
        big = torch.empty(512)  # 2 KiB
        copy_into(big, src)
        small = torch.empty(8)  # 32 bytes
        copy_into(small, small_src)
        return big.sum() + small.sum()
    src, small_src = torch.randn(512), torch.randn(8)
    rec, out = record(fn, src, small_src)
    prog = replay.Program(rec, rec.template(out))
    assert prog.pooled == 1 and _pool_bytes(prog) == [256], prog.source
    src2, small2 = torch.randn(512), torch.randn(8)
    got, _ = prog((src2, small2))
    assert torch.equal(got, src2.sum() + small2.sum())


class _CopySite:
    """A fake planned GEMM: copies ``nbytes`` from ``src`` to ``dst``; replayed through ``by_address`` (as a
    cuBLASLt site is), recorded through ``Recorder.call``."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __call__(self, src, dst):
        self.by_address(src.data_ptr(), dst.data_ptr())

    def by_address(self, src: int, dst: int):
        import ctypes

        ctypes.memmove(dst, src, self.nbytes)


def _site_call(site, *args):
    from fp8engine.kernels import _common

    rec = _common.RECORDER.get()
    return rec.call(site, *args) if rec is not None else site(*args)


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "nopool"])
def test_a_block_read_through_a_reshape_by_a_site_and_a_launch(monkeypatch, pool):
    """The norm-then-GEMM pattern of the layer step: a ``[s, b, h]`` block written by a launch, its 2-D reshape
    read by a planned GEMM (by address) and, through a ``view(torch.uint8)``, by another launch. The reshape is
    folded into the allocation; the folded view must not be taken for a view again (its readers would be pointed
    at a slot nothing makes)."""
    monkeypatch.setattr(replay, "POOL", pool)
    copy_into = _copying_launcher(monkeypatch)
    site = _CopySite(64 * 4)

    def fn(src):
        out = torch.empty(16, 1, 4)
        copy_into(out, src)
        ln = out.reshape(-1, 4)
        res = torch.empty(16, 4)
        _site_call(site, ln, res)
        t = torch.empty(64)
        copy_into(t, ln.view(torch.uint8))  # (as the layer's transpose launch takes its FP8 operand)
        return res * 1, t * 1
    rec, out = record(fn, torch.arange(64.0))
    prog = replay.Program(rec, rec.template(out))
    src2 = torch.randn(64)
    (res, t), _ = prog((src2,))
    assert torch.equal(res.flatten(), src2) and torch.equal(t, src2)


def test_pooling_off_allocates_each_block(monkeypatch):
    monkeypatch.setattr(replay, "POOL", False)
    copy_into = _copying_launcher(monkeypatch)

    def fn(src):
        buf = torch.empty(32)
        copy_into(buf, src)
        return buf.sum()
    rec, out = record(fn, torch.randn(32))
    prog = replay.Program(rec, rec.template(out))
    assert prog.pooled == 0 and "_a0" not in prog.source


# ---------------------------------------------------------------------------------------------------------------
# The fused FP8 layer step
# ---------------------------------------------------------------------------------------------------------------
def _run(layer, xs, gs, recipe, rope, on: bool, kernels: bool = False, **autocast):
    """Steps with replay ``on`` / off; the outputs, input gradients, and the replay cache after the steps (kept)."""
    out, cache, _ = replay_layer_steps(layer, xs, gs, recipe, on, rope, kernels, keep_cache=True, **autocast)
    return out, cache


def _assert_replay_exact(recipe, kw, rope, kernels=False, steps=3):
    torch.manual_seed(0)
    replayed = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    ordinary = copy.deepcopy(replayed)
    freqs = RotaryEmbedding(H // HEADS)(S) if rope else None
    xs = [torch.randn(S, B, H) for _ in range(steps)]
    gs = [torch.randn(S, B, H) for _ in range(steps)]
    calls = []
    real = replay.Pair.forward
    replay.Pair.forward = lambda self, inputs: calls.append(1) or real(self, inputs)
    try:
        a, cache = _run(replayed, xs, gs, recipe, freqs, True, kernels)
    finally:
        replay.Pair.forward = real
    b, _ = _run(ordinary, xs, gs, recipe, freqs, False, kernels)
    assert [type(v) for v in cache.values()] == [replay.Pair], cache
    assert len(calls) == steps - 1  # the first step records, the others replay
    for (y1, dx1), (y2, dx2) in zip(a, b):
        assert torch.equal(y1, y2) and torch.equal(dx1, dx2)  # the same ops on the same inputs: exact
    for (name, p1), p2 in zip(replayed.named_parameters(), ordinary.parameters()):
        assert torch.equal(p1.grad, p2.grad), name
    for (name, b1), b2 in zip(replayed.named_buffers(), ordinary.buffers()):  # amax histories, scales
        assert torch.equal(b1, b2), name


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("kw", [dict(), dict(activation="relu", bias=False, zero_centered_gamma=True,
                                             normalization="RMSNorm")], ids=["gelu-ln", "relu-nobias-rms"])
@pytest.mark.parametrize("rope", [False, True], ids=["norope", "rope"])
def test_replayed_layer_step_equals_the_ordinary_one(recipe, kw, rope):
    _assert_replay_exact(recipe, kw, rope)


@pytest.mark.skipif(not interpreting(), reason="the Triton kernel path on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_replayed_layer_step_equals_the_ordinary_one_on_the_kernel_path(recipe):
    """The Triton kernels (interpreted; launches replayed through ``kernel[grid]``) with rotary embedding."""
    _assert_replay_exact(recipe, dict(), True, kernels=True, steps=2)


@pytest.mark.parametrize("kw, why", [(dict(hidden_dropout=0.1), None), (dict(attention_dropout=0.1), None),
                                     (dict(num_gqa_groups=2), "autograd graph")], ids=["hidden-dropout",
                                                                                       "attn-dropout", "gqa"])
def test_not_replayed_where_the_recording_is_not_sound(kw, why):
    """Dropout is not recorded (its RNG draws and nodes: no key); GQA keeps SDPA's autograd node, which aborts
    the recording: the layer then keeps its ordinary Python, with the same results."""
    kw = {"hidden_dropout": 0.0, "attention_dropout": 0.0, **kw}
    torch.manual_seed(0)
    layer = TransformerLayer(H, FFN, HEADS, **kw)
    xs = [torch.randn(S, B, H) for _ in range(2)]
    _, cache = _run(layer, xs, [torch.randn_like(x) for x in xs], fp8engine.DelayedScaling(), None, True)
    if why is None:
        assert cache == {}
    else:
        assert len(cache) == 1 and why in next(iter(cache.values()))


def test_a_new_shape_records_again():
    torch.manual_seed(0)
    layer = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    xs = [torch.randn(S, B, H), torch.randn(S, B, H), torch.randn(S // 2, B, H)]
    _, cache = _run(layer, xs, [torch.randn_like(x) for x in xs], fp8engine.DelayedScaling(), None, True)
    assert [type(v) for v in cache.values()] == [replay.Pair, replay.Pair]
    assert [key[1][0][0] for key in cache] == [xs[0].shape, xs[2].shape]  # the keys' first input: x


def test_the_key_holds_the_dispatch_state():
    """torch.autocast casts some ops' inputs (the amax reduction runs in fp32 under it) and the SDPA switches pick
    the attention backend: a step recorded under one state is not replayed under another. (The kernels' backend
    is in the quantizers' part of the key, ``_replay_config``: ``test_backend_is_in_the_config_key``.)"""
    x = torch.randn(S, B, H)
    plain = layer_mod._dispatch_state(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer_mod._dispatch_state(x) != plain
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert layer_mod._dispatch_state(x) != plain
    assert layer_mod._dispatch_state(x) == plain


@pytest.mark.skipif(not interpreting(), reason="kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_backend_is_in_the_config_key():
    """The same layer's plan under the torch backend and under the kernels (forced on CPU) has different keys."""
    layer = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    seen = []
    real = layer_mod._replay_config

    def spy(plan):
        seen.append(real(plan))
        return seen[-1]

    layer_mod._replay_config, saved = spy, layer_mod._replay_config
    try:
        for forced in (False, True):
            with kernels_forced(forced), fp8engine.autocast(recipe=fp8engine.DelayedScaling()):
                layer(torch.randn(S, B, H, requires_grad=True))
    finally:
        layer_mod._replay_config = saved
        layer_mod._PROGRAMS.clear()
    assert len(seen) == 2 and seen[0] is not None and seen[0] != seen[1]


def test_replayed_step_keeps_autograds_in_place_check():
    """A saved weight modified in place between forward and backward raises, replayed or not."""
    torch.manual_seed(0)
    layer = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0)
    xs = [torch.randn(S, B, H) for _ in range(2)]
    _, cache = _run(layer, xs, [torch.randn_like(x) for x in xs], fp8engine.DelayedScaling(), None, True)
    assert [type(v) for v in cache.values()] == [replay.Pair]  # (kept in layer_mod._PROGRAMS: the next replays)
    x = xs[0].clone().requires_grad_()
    with fp8engine.autocast(recipe=fp8engine.DelayedScaling()):
        y = layer(x)
    with torch.no_grad():
        layer.layernorm_mlp.fc1_weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    layer_mod._PROGRAMS.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_replayed_layer_step_on_cuda(recipe):
    """On the GPU as the training command runs it (fp32 master parameters, bf16 under ``torch.autocast``), over
    three steps (the first records, two replay). The forward and every gradient computed before the attention's
    backward (the MLP's weights and norm) are the same bits; SDPA's backward accumulates with atomics on CUDA (its
    bits vary from run to run, replayed or not), so the gradients behind it are compared at 25 dB, and the
    scaling state, which takes their amaxes, by the forward roles' rows exactly and all rows at 25 dB."""
    torch.manual_seed(0)
    replayed = TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device="cuda")
    ordinary = copy.deepcopy(replayed)
    freqs = RotaryEmbedding(H // HEADS)(S).cuda()
    xs = [torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    gs = [torch.randn_like(x) for x in xs]
    a, cache = _run(replayed, xs, gs, recipe, freqs, True, device_type="cuda", dtype=torch.bfloat16)
    b, _ = _run(ordinary, xs, gs, recipe, freqs, False, device_type="cuda", dtype=torch.bfloat16)
    assert [type(v) for v in cache.values()] == [replay.Pair], cache
    for (y1, dx1), (y2, dx2) in zip(a, b):
        assert torch.equal(y1, y2)
        assert sqnr(dx2, dx1) > 25
    p1, p2 = dict(replayed.named_parameters()), dict(ordinary.named_parameters())
    for name in p1:
        if name.startswith("layernorm_mlp."):
            assert torch.equal(p1[name].grad, p2[name].grad), name
        else:
            assert sqnr(p2[name].grad.float(), p1[name].grad.float()) > 25, name
    for (name, b1), b2 in zip(replayed.named_buffers(), ordinary.buffers()):
        assert sqnr(b2.float(), b1.float()) > 25, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_step_peak_memory_on_cuda():
    """A replay releases each tensor after its last use, as the ordinary step drops its intermediates (the
    backward empties the forward's saved list as it goes): the peak of a step is the ordinary step's, to the
    caching allocator's block rounding (1 %)."""
    torch.manual_seed(0)
    layer = TransformerLayer(512, 2048, 8, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                             device="cuda")
    x = torch.randn(256, 4, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    def peak(on: bool) -> int:
        layer_mod._PROGRAMS.clear()
        saved, layer_mod.REPLAY = layer_mod.REPLAY, on
        try:
            for _ in range(3):  # the first records; the peak is the last step's
                x.grad = None
                for p in layer.parameters():
                    p.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                with fp8engine.autocast(recipe=fp8engine.DelayedScaling()):
                    y = layer(x)
                y.backward(g)
                del y
                torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        finally:
            layer_mod.REPLAY = saved
    assert peak(True) <= peak(False) * 1.01
