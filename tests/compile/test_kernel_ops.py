"""The Triton kernels' custom ops (:mod:`fp8engine.ops.kernel_ops`): schema, fake implementation and declared
mutation (``torch.library.opcheck``), bits equal to the launchers they wrap, a compiled ``LayerNormMLP`` and
``TransformerLayer`` that call them (on CPU their plain-PyTorch references; the tests force the op path, which CUDA
takes by itself), and compiled current scaling's norm and activation bit-equal to eager mode's kernel path."""
import copy

import pytest
import torch

import fp8engine.modules as M
import fp8engine.ops.mlp as mlp_ops
from fp8engine.fp8.autocast import fp8_autocast
from fp8engine.kernels import activation as ka
from fp8engine.ops.kernel_ops import ACT_KINDS, act_bwd_dbias_amax, act_bwd_fp8, act_fwd_amax, act_fwd_fp8
from fp8engine.recipe import DelayedScaling
from tests.conftest import DEVICES, sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(kind, device, rows=64, cols=96):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, 2 * cols if kind == "swiglu" else cols, generator=g) * 3).to(device, torch.bfloat16)
    da = torch.randn(rows, cols, generator=g).to(device, torch.bfloat16)
    return h, da


@pytest.mark.parametrize("kind", list(ACT_KINDS))
def test_opcheck(kind):
    """Schema, fake (meta) outputs, declared mutation of ``amax`` and autograd registration agree (CPU)."""
    h, da = _inputs(kind, "cpu")
    scale = torch.tensor([4.0])
    torch.library.opcheck(act_fwd_fp8, (h, kind, scale, E4M3, torch.zeros(1)))
    torch.library.opcheck(act_bwd_fp8, (da, h, kind, scale, E5M2, torch.zeros(1)))
    torch.library.opcheck(act_fwd_amax, (h, kind, torch.zeros(1)))  # current scaling's high-precision variants
    torch.library.opcheck(act_bwd_dbias_amax, (da, h, kind, torch.zeros(1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(ACT_KINDS))
def test_ops_equal_the_launchers(kind, device):
    """Exact: the op returns the launcher's outputs (the kernel on CUDA, its reference elsewhere) and max-accumulates
    the same amax."""
    h, da = _inputs(kind, device)
    scale = torch.tensor([4.0], device=device)
    fwd, bwd = (getattr(ka, n if device == "cuda" else n + "_reference") for n in ACT_KINDS[kind])
    amax_op, amax_ref = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
    y8, sinv = act_fwd_fp8(h, kind, scale, E4M3, amax_op)
    _, y8_ref, sinv_ref = fwd(h, scale=scale, fp8_dtype=E4M3, amax_out=amax_ref)
    assert torch.equal(y8.view(torch.uint8), y8_ref.view(torch.uint8)) and torch.equal(sinv, sinv_ref)
    assert torch.equal(amax_op, amax_ref) and amax_op.item() > 0.5
    amax_op.zero_(), amax_ref.zero_()
    out = act_bwd_fp8(da, h, kind, scale, E5M2, amax_op)
    ref = bwd(da, h, scale, E5M2, amax_ref)
    for a, b in zip(out, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E5M2 else a, b.view(torch.uint8) if b.dtype == E5M2 else b)
    assert torch.equal(amax_op, amax_ref)
    # current scaling's variants: high precision and the amax of the values written
    amax_op, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    y = act_fwd_amax(h, kind, amax_op)
    y_ref, _, _ = fwd(h, return_hp=True, amax_out=amax_ref)
    assert y.dtype == h.dtype and torch.equal(y, y_ref) and torch.equal(amax_op, amax_ref)
    assert amax_op.item() == y.abs().max().item() > 0
    amax_op.zero_(), amax_ref.zero_()
    dh, db = act_bwd_dbias_amax(da, h, kind, amax_op)
    dh_ref, _, _, db_ref = bwd(da, h, None, None, amax_ref)
    assert dh.dtype == da.dtype and torch.equal(dh, dh_ref) and torch.equal(db, db_ref)
    assert torch.equal(amax_op, amax_ref) and amax_op.item() == dh.abs().max().item() > 0


def _three_steps_agree(eager, compiled, recipe, min_db, **kw):
    """Three FP8 steps of ``eager`` and ``compiled`` on the same ``[16, 2, 64]`` inputs (``kw``: the modules' other
    arguments): outputs and input gradients within ``min_db`` of each other at every step (each caller says why its
    bound)."""
    for step in range(3):
        x = torch.randn(16, 2, 64) * (step + 1)
        outs = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                y = mod(xi, **kw)
            y.square().mean().backward()
            outs.append((y.detach(), xi.grad))
            mod.zero_grad(set_to_none=True)
        assert sqnr(outs[0][0], outs[1][0]) > min_db and sqnr(outs[0][1], outs[1][1]) > min_db, step


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_compiled_mlp_through_the_ops(monkeypatch, activation):
    """A compiled ``LayerNormMLP`` (Inductor, CPU) taking the op path, three delayed-scaling steps against eager mode:
    outputs and input gradients within 30 dB (the ops run the activation reference's formula, eager mode's torch
    path ``F.gelu`` / ``F.silu``: the same function rounded differently, then FP8-cast; one FP8 step on an element is
    ~2^-4 relative for e4m3), the activation rows of the FP8 state (fc2's input, fc1's grad_output) to 1 %. GELU
    without fc1's epilogue (which takes the activation forward into the GEMM op: tests/compile/test_gemm_ops.py)."""
    torch._dynamo.reset()
    calls = []
    real = mlp_ops.act_fwd_fp8

    def counting(*args):
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(mlp_ops, "compiled_kernel_ops", lambda x: torch.compiler.is_compiling())
    monkeypatch.setattr(mlp_ops, "act_fwd_fp8", counting)
    torch.manual_seed(0)
    eager = M.LayerNormMLP(64, 128, activation=activation, gelu_epilogue=False)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True)
    recipe = DelayedScaling(amax_history_len=4)
    _three_steps_agree(eager, compiled, recipe, min_db=30)
    assert calls, "the compiled forward did not call the custom op"
    from fp8engine.fp8.library import fold_grad_amax

    fold_grad_amax([compiled_mod.fp8_state])
    torch.testing.assert_close(compiled_mod.fp8_state.scale, eager.fp8_state.scale, rtol=1e-2, atol=0)


def _x(device, rows=64, cols=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(device, torch.bfloat16)


def test_cast_and_norm_opcheck():
    """Schema, fake outputs and declared (optional) amax mutation of the cast and norm ops (CPU)."""
    from fp8engine.ops.kernel_ops import cast_fp8, cast_transpose_dbias_fp8, norm_bwd, norm_fwd_fp8

    x, scale = _x("cpu"), torch.tensor([4.0])
    for transpose in (False, True):
        torch.library.opcheck(cast_fp8, (x, scale, E4M3, torch.zeros(1), transpose, False))
        torch.library.opcheck(cast_fp8, (x, torch.tensor(7.0), E4M3, None, transpose, True))
    torch.library.opcheck(cast_transpose_dbias_fp8, (x, scale, E5M2, torch.zeros(1), False))
    # current scaling hands its amax over in x's dtype (Quantizer._kernel_args): the fake scale_inv must still be
    # float32, as the kernels write it (a bf16 one made the compiled bf16 layer's torch._scaled_mm fail on CUDA)
    amax_bf16 = x.abs().amax()
    assert amax_bf16.dtype == torch.bfloat16
    torch.library.opcheck(cast_fp8, (x, amax_bf16, E4M3, None, True, True))
    torch.library.opcheck(cast_transpose_dbias_fp8, (x, amax_bf16, E5M2, None, True))
    w, b = torch.randn(96).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    for rms in (False, True):
        for residual in (None, _x("cpu", seed=2)):
            args = (x, w, None if rms else b, residual, 1e-5, rms, False, scale, E4M3, torch.zeros(1), True)
            torch.library.opcheck(norm_fwd_fp8, args)
            # current scaling: no FP8 output, y and the amax of the y written
            torch.library.opcheck(norm_fwd_fp8, (*args[:7], None, None, torch.zeros(1), True))
            _, _, _, mean, rstd, _ = norm_fwd_fp8(*args)
            torch.library.opcheck(norm_bwd, (_x("cpu", seed=3), x, mean, rstd, w, residual, rms, False))


@pytest.mark.parametrize("device", DEVICES)
def test_cast_and_norm_ops_equal_the_launchers(device):
    """Exact: each op returns its launcher's outputs (kernel on CUDA, reference elsewhere), amax included."""
    from fp8engine.kernels import cast as kc, norm as kn
    from fp8engine.ops.kernel_ops import cast_fp8, cast_transpose_dbias_fp8, norm_bwd, norm_fwd_fp8

    sfx = "" if device == "cuda" else "_reference"
    x, scale = _x(device), torch.tensor([4.0], device=device)
    u8 = lambda t: t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t  # noqa: E731
    for transpose in (False, True):
        a_op, a_ref = torch.full((1,), 0.5, device=device), torch.full((1,), 0.5, device=device)
        out = cast_fp8(x, scale, E4M3, a_op, transpose, False)
        ref = getattr(kc, "cast_to_fp8" + sfx)(x, scale, E4M3, a_ref, transpose=transpose)
        assert torch.equal(u8(out[0]), u8(ref[0])) and torch.equal(out[2], ref[2]) and torch.equal(a_op, a_ref)
        assert torch.equal(u8(out[1]), u8(ref[1])) if transpose else out[1].numel() == 0
    amax = x.float().abs().amax()
    out = cast_fp8(x, amax, E4M3, None, False, True)
    ref = getattr(kc, "cast_to_fp8" + sfx)(x, amax, E4M3, None, scale_from_amax=True)
    assert torch.equal(u8(out[0]), u8(ref[0])) and torch.equal(out[2], ref[2])
    a_op, a_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    out = cast_transpose_dbias_fp8(x, scale, E5M2, a_op, False)
    ref = getattr(kc, "cast_transpose_dbias" + sfx)(x, scale, E5M2, a_ref)
    assert all(torch.equal(u8(o), u8(r)) for o, r in zip(out, ref)) and torch.equal(a_op, a_ref)
    w = torch.randn(96, device=device).to(torch.bfloat16)
    b = torch.randn(96, device=device).to(torch.bfloat16)
    res, dy = _x(device, seed=2), _x(device, seed=3)
    a_op, a_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    y, y8, sinv, mean, rstd, s = norm_fwd_fp8(x, w, b, res, 1e-5, False, False, scale, E4M3, a_op, True)
    r_out = torch.empty_like(x)
    ry, ry8, rsinv, rmean, rrstd = getattr(kn, "layernorm_fwd" + sfx)(x, w, b, 1e-5, scale=scale, fp8_dtype=E4M3,
                                                                      amax_out=a_ref, residual=res, residual_out=r_out)
    for a, b_ in ((y, ry), (y8, ry8), (sinv, rsinv), (mean, rmean), (rstd, rrstd), (s, r_out), (a_op, a_ref)):
        assert torch.equal(u8(a), u8(b_))
    # current scaling's mode: y and the amax of the y written, no FP8 output
    a_op, a_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    y_c, y8_c, sinv_c, _, _, _ = norm_fwd_fp8(x, w, b, res, 1e-5, False, False, None, None, a_op, True)
    ry_c = getattr(kn, "layernorm_fwd" + sfx)(x, w, b, 1e-5, amax_out=a_ref, residual=res,
                                              residual_out=torch.empty_like(x))[0]
    assert torch.equal(y_c, ry_c) and torch.equal(a_op, a_ref) and a_op.item() == y_c.abs().max().item()
    assert y8_c.numel() == 0 and sinv_c.numel() == 0
    dx, dw, db = norm_bwd(dy, s, mean, rstd, w, res, False, False)
    rdx, rdw, rdb = getattr(kn, "layernorm_bwd" + sfx)(dy, r_out, rmean, rrstd, w, dresidual=res)
    assert torch.equal(dx, rdx) and torch.equal(dw, rdw) and torch.equal(db, rdb)


@pytest.mark.parametrize("recipe_name,normalization,activation", [
    ("delayed", "LayerNorm", "gelu"), ("delayed", "RMSNorm", "gelu"), ("current", "LayerNorm", "gelu"),
    ("current", "RMSNorm", "gelu"), ("current", "LayerNorm", "swiglu"), ("current", "RMSNorm", "swiglu")])
def test_compiled_layer_through_the_kernel_ops(monkeypatch, recipe_name, normalization, activation):
    """A compiled ``TransformerLayer`` with rotary embedding (Inductor, CPU) with every kernel op forced on (what
    CUDA takes by itself), three steps against eager mode. Bounds: outputs and input gradients within 25 dB (the op path runs the
    kernels' fp32 references where eager CPU mode runs torch's norms and activations: the same functions rounded
    differently, then FP8-cast, ~2^-4 relative per e4m3 step, through two sublayers). The ops are called, counted
    at run time (they are opaque to the trace): the cast and the cast-transpose with dbias, and once per step the
    norm forward and backward of both sublayers and the activation forward and backward, under both recipes
    (current scaling: the norm and activation write high precision and its amax, then the cast op scales by it;
    delayed scaling with GELU: the activation forward runs in fc1's GELU-GEMM op, :mod:`fp8engine.ops.gemm_ops`);
    the rotation of q and k once per forward, and under delayed scaling the QKV gradient cast (with the rotation's
    gradient) once per backward (current scaling casts the assembled gradient)."""
    import fp8engine.fp8.cast_ops as co
    import fp8engine.ops.kernel_ops as ko
    import fp8engine.ops.norm_linear as nl
    from fp8engine.recipe import CurrentScaling

    torch._dynamo.reset()
    calls = {}

    def count(fn):
        def f(*a, **k):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return fn(*a, **k)
        return f

    def counting(launchers):  # the launchers an op picks, counted when called
        return lambda *args: tuple(count(fn) for fn in launchers(*args))

    forced = lambda x: torch.compiler.is_compiling()  # noqa: E731
    for mod in (co, ko, nl, mlp_ops):
        monkeypatch.setattr(mod, "compiled_kernel_ops", forced)
    monkeypatch.setattr(co, "_cast_launchers", counting(co._cast_launchers))
    monkeypatch.setattr(ko, "_norm_launchers", counting(ko._norm_launchers))
    monkeypatch.setattr(ko, "_rope_launchers", counting(ko._rope_launchers))
    act_launcher = ko._launcher
    monkeypatch.setattr(ko, "_launcher", lambda *args: count(act_launcher(*args)))
    import fp8engine.ops.gemm_ops as go

    monkeypatch.setattr(go, "_gemm_bias_gelu_reference", count(go._gemm_bias_gelu_reference))
    torch.manual_seed(0)
    eager = M.TransformerLayer(64, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization=normalization,
                               activation=activation)
    eager.layernorm_mlp.gelu_epilogue = True  # (by default only at large sizes: fp8engine.ops.mlp.use_gelu_epilogue)
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True)
    recipe = DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else CurrentScaling()
    from fp8engine.modules.attention import RotaryEmbedding

    _three_steps_agree(eager, compiled, recipe, min_db=25, rotary_pos_emb=RotaryEmbedding(16)(16))
    norm = "rmsnorm" if normalization == "RMSNorm" else "layernorm"
    fwd, bwd = ACT_KINDS[activation]
    assert {"cast_to_fp8_reference", "cast_transpose_dbias_reference"} <= set(calls), calls
    epilogue = recipe_name == "delayed" and activation == "gelu"  # fc1's GEMM writes the activation
    want = {f"{norm}_fwd_reference": 6, f"{norm}_bwd_reference": 6, f"{fwd}_reference": None if epilogue else 3,
            f"{bwd}_reference": 3, "_gemm_bias_gelu_reference": 3 if epilogue else None, "_rope_qk_reference": 3,
            "_qkv_grad_reference": 3 if recipe_name == "delayed" else None}
    assert {k: calls.get(k) for k in want} == want, calls


@pytest.mark.parametrize("rms", [False, True])
def test_compiled_norm_with_residual_matches_eager(rms):
    """``norm(x, residual=r, return_input=True)`` compiled (Inductor, fp32) against eager: gradients of x, r and the
    weight within 100 dB (fp32 rounding only). Under torch 2.11 the traced plain-PyTorch RMSNorm gave x and r
    gradients 12 dB off; compiled RMSNorm now runs the norm op (kernel reference on CPU)."""
    from fp8engine.ops.norm_linear import norm

    torch._dynamo.reset()
    torch.manual_seed(0)
    w, b = torch.randn(64), (None if rms else torch.randn(64))

    def f(x, r, w):
        y, s = norm(x, w, b, 1e-5, rms=rms, residual=r, return_input=True, kernels=False)
        return y.square().sum() + (0.5 * s).square().sum()

    grads, data = [], (torch.randn(8, 2, 64), torch.randn(8, 2, 64), w)
    for fn in (f, torch.compile(f, fullgraph=True)):
        x, r, wi = (t.clone().requires_grad_() for t in data)
        fn(x, r, wi).backward()
        grads.append((x.grad, r.grad, wi.grad))
    for a, c in zip(*grads):
        assert sqnr(a, c) > 100


def _current_scaling_both_ways(monkeypatch, device):
    """Compiled current scaling against eager mode's kernel path, on ``device``: returns the context eager mode runs
    its kernels in. CUDA: the kernels, which compiled code reaches through the ops by itself. CPU: the ops are forced
    on (they run the launchers' references) and eager mode's kernel composition runs with every launcher replaced by
    its reference (under ``kernels_forced``), so both sides call the same functions."""
    import fp8engine.fp8.cast_ops as co
    import fp8engine.ops.norm_linear as nl
    from fp8engine.fp8.float8_tensor import kernels_forced
    from fp8engine.kernels import cast as kc, norm as kn

    torch._dynamo.reset()
    if device == "cpu":
        forced = lambda x: torch.compiler.is_compiling()  # noqa: E731
        for mod in (co, nl, mlp_ops):
            monkeypatch.setattr(mod, "compiled_kernel_ops", forced)
        launchers = ((kc, ("cast_to_fp8", "cast_transpose_dbias")), (ka, sum(ACT_KINDS.values(), ())),
                     (kn, ("layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd")))
        for mod, names in launchers:
            for name in names:
                monkeypatch.setattr(mod, name, getattr(mod, name + "_reference"))
    return kernels_forced(device == "cpu")


def _fields(t):
    return t.data.view(torch.uint8), t.transpose_2d().view(torch.uint8), t.scale_inv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_compiled_current_scaling_activation_equals_eager_kernels(monkeypatch, kind, device):
    """Exact: under current scaling the compiled activation (``act_fwd_amax`` then ``cast_fp8`` with the kernel's
    amax) and its backward (``act_bwd_dbias_amax`` then ``cast_fp8`` with the transpose) write the bits eager mode's
    kernels write: FP8 data, transposed data, scale_inv, dbias. 67 rows (odd: partial tiles)."""
    from fp8engine.fp8.quantizer import Quantizer
    from fp8engine.ops.mlp import act_bwd_cast, act_fwd_cast

    eager_kernels = _current_scaling_both_ways(monkeypatch, device)
    h, da = _inputs(kind, device, rows=67)
    # eager: the kernel backend (what get_quantizers gives a CUDA module); compiled: the traced one (kernels False)
    qs = {k: (Quantizer(E4M3, "current", role="fc2_input", kernels=k),
              Quantizer(E5M2, "current", role="fc1_grad_output", kernels=k)) for k in (False, True)}

    def step(h, da):
        fwd_q, bwd_q = qs[not torch.compiler.is_compiling()]
        dh, dbias = act_bwd_cast(da, h, kind, bwd_q, transpose=True, dbias=True)
        return (*_fields(act_fwd_cast(h, kind, fwd_q, transpose=True)), *_fields(dh), dbias)

    got = torch.compile(step, fullgraph=True)(h, da)
    with eager_kernels:
        want = step(h, da)
    assert got[0].shape == (67, h.shape[1] // (2 if kind == "swiglu" else 1))
    for name, a, b in zip(("y8", "y8_t", "scale_inv", "dh8", "dh8_t", "scale_inv", "dbias"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rms", [False, True])
def test_compiled_current_scaling_norm_equals_eager_kernels(monkeypatch, rms, device):
    """Exact: under current scaling the compiled norm with a residual (``norm_fwd_fp8`` writing y and its amax, then
    ``cast_fp8`` with that amax and the transpose) writes the bits eager mode's kernels write, and its backward
    (``norm_bwd``) the same gradients. 67 rows."""
    from fp8engine.fp8.quantizer import Quantizer
    from fp8engine.ops.norm_linear import norm_bwd, norm_fwd

    eager_kernels = _current_scaling_both_ways(monkeypatch, device)
    x, res, dy = _x(device, rows=67), _x(device, rows=67, seed=2), _x(device, rows=67, seed=3)
    w = torch.randn(96, device=device).to(torch.bfloat16)
    b = None if rms else torch.randn(96, device=device).to(torch.bfloat16)
    qs = {k: Quantizer(E4M3, "current", role="fc1_input", kernels=k) for k in (False, True)}

    def step(x, res, dy):
        op_path = torch.compiler.is_compiling()  # the compiled forward ran the op, whose mean / rstd layout it reads
        y, y_fp8, mean, rstd, s = norm_fwd(x, w, b, 1e-5, rms=rms, zero_centered_gamma=False, quantizer=qs[not op_path],
                                           transpose=True, residual=res, kernels=not op_path)
        dx, dw, db = norm_bwd(dy, s, mean, rstd, w, rms=rms, zero_centered_gamma=False, has_bias=not rms,
                              dresidual=dy, op_path=op_path, kernels=not op_path)
        return (y, *_fields(y_fp8), s, dx, dw) + (() if rms else (db,))

    got = torch.compile(step, fullgraph=True)(x, res, dy)
    with eager_kernels:
        want = step(x, res, dy)
    for name, a, c in zip(("y", "y8", "y8_t", "scale_inv", "s", "dx", "dw", "db"), got, want):
        assert torch.equal(a, c), name


def _qkv_grads(device, s=8, b=2, g=2, hpg=2, d=16):
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(s, b, g, hpg + 2, d, generator=gen).to(device, torch.bfloat16)
    # SDPA-like strides: views of one buffer
    return full[..., :hpg, :], full[..., hpg, :], full[..., hpg + 1, :]


def test_rope_qkv_grad_and_transpose_opcheck():
    """Schema, fake outputs (shapes, dtypes, strides) and declared amax mutation of the rotary op, the QKV gradient
    cast op (with and without the rotation) and the FP8 transpose op (CPU)."""
    from fp8engine.fp8.cast_ops import transpose_fp8
    from fp8engine.ops.kernel_ops import qkv_grad_cast_fp8, rope_qk
    from fp8engine.ops.rotary import rope_cos_sin

    g, hpg, d, s, b = 2, 2, 16, 8, 2
    qkv = _x("cpu", rows=s * b, cols=g * (hpg + 2) * d).view(s, b, -1)
    for r in (d, d // 2):  # full and partial rotary
        cos, sin = rope_cos_sin(torch.randn(s, 1, 1, r), torch.bfloat16)
        torch.library.opcheck(rope_qk, (qkv, cos, sin, g, hpg, d, b))
        torch.library.opcheck(qkv_grad_cast_fp8, (*_qkv_grads("cpu"), torch.tensor([4.0]), E5M2, torch.zeros(1),
                                                  cos, sin))
    torch.library.opcheck(qkv_grad_cast_fp8, (*_qkv_grads("cpu"), torch.tensor([4.0]), E5M2, None, None, None))
    # (the schema check compares the input before and after with float ops FP8 lacks on CPU: skipped for this op;
    # it takes one tensor and declares no mutation)
    torch.library.opcheck(transpose_fp8, (_x("cpu").to(E4M3),),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
def test_rope_qkv_grad_and_transpose_ops_equal_the_eager_path(device):
    """Exact: the rotary op gives ``rope_fwd`` of the q and k views, the QKV gradient cast op gives ``rope_bwd`` then
    the assembled gradient's cast-transpose-dbias (its amax too), and the transpose op the transposed bytes: on CUDA
    the kernels, elsewhere the references, each against the plain-PyTorch formulas (the kernels are bit-exact to them,
    tests/kernels/test_rotary_kernel.py; here through the ops)."""
    from fp8engine.fp8.cast_ops import transpose_fp8
    from fp8engine.kernels.cast import cast_transpose_dbias_reference
    from fp8engine.kernels.qkv_grad import assemble_qkv_grad
    from fp8engine.ops.kernel_ops import qkv_grad_cast_fp8, rope_qk
    from fp8engine.ops.rotary import rope_bwd, rope_cos_sin, rope_fwd

    g, hpg, d, s, b = 2, 2, 16, 8, 2
    u8 = lambda t: t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t  # noqa: E731
    qkv = _x(device, rows=s * b, cols=g * (hpg + 2) * d).view(s, b, -1)
    grouped = qkv.view(s, b, g, hpg + 2, d)
    for r in (d, d // 2):
        cos, sin = rope_cos_sin(torch.randn(s, 1, 1, r).to(device), torch.bfloat16)
        q, k = rope_qk(qkv, cos, sin, g, hpg, d, b)
        assert torch.equal(q, rope_fwd(grouped[..., :hpg, :].reshape(s, b, g * hpg, d), cos, sin))
        assert torch.equal(k, rope_fwd(grouped[..., hpg, :], cos, sin))
        dq, dk, dv = _qkv_grads(device)
        a_op, a_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
        scale = torch.tensor([4.0], device=device)
        out = qkv_grad_cast_fp8(dq, dk, dv, scale, E5M2, a_op, cos, sin)
        dq_r = rope_bwd(dq.reshape(s, b, g * hpg, d), cos, sin).view(s, b, g, hpg, d)
        ref = cast_transpose_dbias_reference(assemble_qkv_grad(dq_r, rope_bwd(dk, cos, sin), dv).reshape(s * b, -1),
                                             scale, E5M2, a_ref)
        for o, rf in zip(out, ref):  # data, data_t, scale_inv exact; dbias: fp32 sums in another order
            if o.dtype == torch.bfloat16:
                torch.testing.assert_close(o, rf, rtol=2 ** -7, atol=1e-2)
            else:
                assert torch.equal(u8(o), u8(rf))
        assert torch.equal(a_op, a_ref) and a_op.item() > 0
    x8 = _x(device).to(E4M3)
    assert torch.equal(u8(transpose_fp8(x8)), u8(x8.t().contiguous()))
