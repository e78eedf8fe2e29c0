"""The cuBLASLt GEMMs' custom ops (:mod:`fp8engine.ops.gemm_ops`): schema, fake implementation and declared mutation
(``torch.library.opcheck``), the CPU references equal to eager CPU mode's composition bit for bit, a compiled
``LayerNormMLP`` whose fc1 runs the GELU-epilogue op and compiled ``fuse_wgrad_accumulation`` through the accumulate
op (on CPU the references; the tests force the op path, which CUDA takes by itself), and on CUDA the ops and the
compiled routing equal to eager mode's cuBLASLt path bit for bit."""
import copy

import pytest
import torch
import torch.nn.functional as F

import fp8engine as fe
import fp8engine.modules as M
import fp8engine.ops.gemm as gemm
import fp8engine.ops.gemm_ops as gemm_ops
import fp8engine.ops.linear as linear_ops
import fp8engine.ops.mlp as mlp_ops
from fp8engine.fp8.autocast import FP8Context, fp8_autocast
from fp8engine.fp8.float8_tensor import Float8Tensor, quantize_torch
from fp8engine.fp8.quantizer import get_quantizers
from fp8engine.fp8.state import ScalingState
from fp8engine.kernels import cublaslt
from fp8engine.ops.gemm_ops import gemm_bias_gelu_fp8, mm_accumulate_fp8
from fp8engine.recipe import DelayedScaling
from tests.conftest import sqnr

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLASLt GEMMs need a GPU")


def _operands(device, m=67, k=64, n=96, seed=0):
    """FP8 ``a [m, K]`` (fc1's input), ``b [n, K]`` (W1) as Float8Tensors and a bf16 ``bias [n]``; 67 rows: odd."""
    g = torch.Generator().manual_seed(seed)
    a = fe.quantize_current(torch.randn(m, k, generator=g).to(device), E4M3)
    b = fe.quantize_current((torch.randn(n, k, generator=g) * k ** -0.5).to(device), E4M3)
    return a, b, (torch.randn(n, generator=g) * 0.5).to(device, BF16)


@pytest.fixture
def fp8_bitwise_schema_check(monkeypatch):
    """opcheck's schema test compares every argument before and after the call with ``torch.allclose``, which has
    no FP8 kernel on CPU: compare FP8 tensors by their bytes instead (what "not mutated" means for them)."""
    allclose = torch.allclose

    def bytewise(a, b, **kwargs):
        if a.dtype in (E4M3, E5M2):
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, **kwargs)

    monkeypatch.setattr(torch, "allclose", bytewise)


@pytest.mark.parametrize("out_dtype,fp8_dtype", [(BF16, E4M3), (torch.float32, E5M2)])
def test_opcheck(fp8_bitwise_schema_check, out_dtype, fp8_dtype):
    """Schema, fake (meta) outputs, declared mutation (``amax``, ``out``) and autograd registration agree (CPU)."""
    a, b, bias = _operands("cpu")
    torch.library.opcheck(gemm_bias_gelu_fp8, (a.data, a.scale_inv, b.data, b.scale_inv, bias, out_dtype,
                                               torch.tensor([4.0]), fp8_dtype, torch.zeros(1)))
    # wgrad dW = dy^T @ x: the token dim (67) is the inner one, zero-padded to 80
    x = _operands("cpu", seed=1)[0]
    dy_t, x_t = a.data.t().contiguous(), x.data.t().contiguous()
    torch.library.opcheck(mm_accumulate_fp8, (dy_t, a.scale_inv, x_t, x.scale_inv, torch.randn(64, 64), True))


def test_cpu_ops_equal_the_reference_composition():
    """Exact: on CPU the GELU-GEMM op returns eager CPU mode's ``fp8_mm`` + bias -> ``F.gelu`` (tanh) -> torch FP8
    cast (``h``, the FP8 bytes, ``scale_inv``, the amax max-accumulated from an earlier value), which is also what
    eager ``fc1_fprop_act`` writes on CPU; the accumulate op adds ``fp8_mm`` in fp32 to ``out`` in place."""
    a, b, bias = _operands("cpu")
    scale = torch.tensor([8.0])
    amax_op, amax_ref = torch.full((1,), 0.25), torch.full((1,), 0.25)
    h, y8, scale_inv = gemm_bias_gelu_fp8(a.data, a.scale_inv, b.data, b.scale_inv, bias, BF16, scale, E4M3, amax_op)
    h_ref = gemm.fp8_mm(a.data, a.scale_inv, b.data, b.scale_inv, BF16, bias=bias, use_fast_accum=True)
    y_ref = quantize_torch(F.gelu(h_ref, approximate="tanh"), E4M3, scale, amax_ref)
    assert h.dtype == BF16 and y8.dtype == E4M3 and h.shape == y8.shape == (67, 96)
    assert torch.equal(h, h_ref) and torch.equal(y8.view(torch.uint8), y_ref.data.view(torch.uint8))
    assert torch.equal(scale_inv, y_ref.scale_inv) and torch.equal(amax_op, amax_ref) and amax_op.item() > 0.25
    # eager fc1_fprop_act on CPU (fp8_gemm, then act_fwd_cast with fc2's input quantizer): the same bits
    state = ScalingState(mlp_ops.MLP_ROLES)
    state.scale[3] = 8.0
    quantizer = get_quantizers(state, FP8Context(DelayedScaling(amax_history_len=4)))[1].input
    h_eager, y_eager = mlp_ops.fc1_fprop_act(a, b, bias, BF16, "gelu", quantizer, transpose=False)
    assert torch.equal(h, h_eager) and torch.equal(y8.view(torch.uint8), y_eager.data.view(torch.uint8))
    assert state.amax_history[3, 0].item() == amax_op.item()
    # the accumulate op: out += a @ b.T in fp32, in place, K = 67 tokens padded to 80
    x = _operands("cpu", seed=1)[0]
    dy_t, x_t = a.data.t().contiguous(), x.data.t().contiguous()
    out = torch.randn(64, 64)
    want = out + gemm.fp8_mm(dy_t, a.scale_inv, x_t, x.scale_inv, torch.float32, pad_inner=True)
    ptr = out.data_ptr()
    mm_accumulate_fp8(dy_t, a.scale_inv, x_t, x.scale_inv, out, True)
    assert out.data_ptr() == ptr and torch.equal(out, want)


def _counting(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper counting its calls at run time (the ops call their references through
    the module's globals); returns the list of calls."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _steps(eager, compiled, steps=3):
    """``steps`` delayed-scaling steps of both on the same ``[16, 2, 64]`` inputs: [(y, dx) eager, compiled]."""
    recipe, outs = DelayedScaling(amax_history_len=4), []
    for step in range(steps):
        x = torch.randn(16, 2, 64) * (step + 1)
        pair = []
        for mod in (eager, compiled):
            xi = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=recipe):
                y = mod(xi)
            y.square().mean().backward()
            pair.append((y.detach(), xi.grad))
        outs.append(pair)
    return outs


def test_compiled_mlp_through_the_gelu_gemm_op(monkeypatch):
    """A compiled ``LayerNormMLP`` (gelu, delayed scaling, Inductor, CPU) with the kernel ops forced on, as CUDA
    takes them: fc1's fprop runs the GELU-GEMM op once per step (counted at run time) and no activation-forward op.
    Against eager mode over three steps: outputs within 60 dB (the op's CPU reference is eager CPU mode's fc1 +
    GELU + cast: measured bit-equal, torch 2.13; an erf GELU or a lost bias flips FP8 steps of ~2^-4 relative and
    lands near 30 dB), input gradients within 30 dB (the forced activation-backward op runs the kernel reference's
    GELU derivative where eager CPU mode runs ATen's, which may flip an FP8 step; measured 133 dB), the fc2-input
    scale after the update to 1 %."""
    torch._dynamo.reset()
    monkeypatch.setattr(mlp_ops, "compiled_kernel_ops", lambda x: torch.compiler.is_compiling())
    gemm_calls = _counting(monkeypatch, gemm_ops, "_gemm_bias_gelu_reference")
    act_calls = _counting(monkeypatch, mlp_ops, "act_fwd_fp8")
    torch.manual_seed(0)
    eager = M.LayerNormMLP(64, 128, activation="gelu", gelu_epilogue=True)  # (by default only at large sizes)
    compiled_mod = copy.deepcopy(eager)
    outs = _steps(eager, torch.compile(compiled_mod, fullgraph=True))
    assert len(gemm_calls) == 3 and not act_calls, (len(gemm_calls), len(act_calls))
    for step, ((y, dx), (y_c, dx_c)) in enumerate(outs):
        assert sqnr(y, y_c) > 60 and sqnr(dx, dx_c) > 30, step
    torch.testing.assert_close(compiled_mod.fp8_state.scale[3], eager.fp8_state.scale[3], rtol=1e-2, atol=0)


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_compiled_fuse_wgrad_through_the_accumulate_op(monkeypatch, module):
    """Compiled ``fuse_wgrad_accumulation`` (Inductor, CPU) with the accumulate op forced on, as CUDA takes it:
    each FP8 wgrad runs the op (counted at run time: one per weight per step) and ``main_grad`` is updated in place
    (the same tensor); after three steps it equals eager mode's to 1e-6 relative (the same FP8 GEMMs and fp32 adds,
    measured bit-equal on CPU, torch 2.13; the slack is for Inductor's own rounding of the fp32 loss-gradient
    arithmetic upstream of the FP8 casts), outputs and input gradients within 60 dB (measured >= 133 dB)."""
    torch._dynamo.reset()
    monkeypatch.setattr(linear_ops, "compiled_gemm_ops", lambda x: torch.compiler.is_compiling())
    calls = _counting(monkeypatch, gemm_ops, "_mm_accumulate_reference")
    torch.manual_seed(0)
    make = dict(Linear=lambda: M.Linear(64, 96, fuse_wgrad_accumulation=True),
                LayerNormMLP=lambda: M.LayerNormMLP(64, 128, fuse_wgrad_accumulation=True))[module]
    eager = make()
    compiled_mod = copy.deepcopy(eager)
    weights = [[p for p in mod.parameters() if p.dim() == 2] for mod in (eager, compiled_mod)]
    for w, w_c in zip(*weights):  # accumulated into, not overwritten
        w.main_grad = torch.randn_like(w, dtype=torch.float32) * 1e-3
        w_c.main_grad = w.main_grad.clone()
    start = [w.main_grad for w in weights[1]]
    outs = _steps(eager, torch.compile(compiled_mod, fullgraph=True))
    assert len(calls) == 3 * len(weights[1]), len(calls)
    assert all(w.main_grad is t for w, t in zip(weights[1], start))
    for w, w_c in zip(*weights):
        assert w.grad is None and w_c.grad is None
        torch.testing.assert_close(w_c.main_grad, w.main_grad, rtol=1e-6, atol=0)
    for step, ((y, dx), (y_c, dx_c)) in enumerate(outs):
        assert sqnr(y, y_c) > 60 and sqnr(dx, dx_c) > 60, step


@cuda
@pytest.mark.parametrize("m", [8192, 1151], ids=["m8192", "m1151"])
def test_ops_equal_eager_cublaslt(m):
    """Exact (CUDA): the GELU-GEMM op returns what eager mode's ``fp8_gemm_bias_gelu`` (the cuBLASLt epilogue)
    writes -- ``h``, the FP8 bytes, ``scale_inv``, the amax max-accumulated -- and the accumulate op adds what
    ``fp8_mm_accumulate`` (cuBLASLt, beta = 1) adds, token dim padded (1151 -> 1152)."""
    x, w, bias = _operands("cuda", m=m, k=256, n=512)
    scale = torch.full((1,), 100.0, device="cuda")
    amax_op, amax_ref = torch.full((1,), 1e-3, device="cuda"), torch.full((1,), 1e-3, device="cuda")
    h, y8, scale_inv = gemm_bias_gelu_fp8(x.data, x.scale_inv, w.data, w.scale_inv, bias, BF16, scale, E4M3, amax_op)
    h_ref, y_ref = gemm.fp8_gemm_bias_gelu(x, w, bias, BF16, scale, E4M3, amax_ref)
    assert torch.equal(h, h_ref) and torch.equal(y8.view(torch.uint8), y_ref.data.view(torch.uint8))
    assert torch.equal(scale_inv, y_ref.scale_inv) and torch.equal(amax_op, amax_ref) and amax_op.item() > 1e-3
    dy = _operands("cuda", m=m, k=512, seed=1)[0]
    out = torch.randn(512, 256, device="cuda")
    ref = out.clone()
    mm_accumulate_fp8(dy.transpose_2d(), dy.scale_inv, x.transpose_2d(), x.scale_inv, out, True)
    gemm.fp8_mm_accumulate(dy.transpose_2d(), dy.scale_inv, x.transpose_2d(), x.scale_inv, ref, pad_inner=True)
    assert torch.equal(out, ref)


@cuda
def test_compiled_routing_equals_eager_cublaslt(monkeypatch):
    """Exact (CUDA, not forced): compiled ``fc1_fprop_act`` (gelu, delayed scaling) and ``fp8_wgrad_accumulate`` call
    cuBLASLt through the ops (counted at run time: once each per call) and write eager mode's bits: ``h``, the FP8
    activation, its ``scale_inv``, the amax history slot, and ``main_grad``. Without the routing the compiled fc1
    would run ``_scaled_mm`` + the activation op (about 2 % of the FP8 bytes one step off, and no cuBLASLt call)."""
    torch._dynamo.reset()
    gelu_calls = _counting(monkeypatch, cublaslt, "scaled_mm_bias_gelu")
    acc_calls = _counting(monkeypatch, cublaslt, "scaled_mm_accumulate")
    x, w, bias = _operands("cuda", m=1151, k=256, n=512)
    dy = _operands("cuda", m=1151, k=512, seed=1)[0]
    dy_t, x_t = dy.transpose_2d(), x.transpose_2d()

    def step(quantizer, main_grad, x8, w8, dy_t, x_t):
        h, y = mlp_ops.fc1_fprop_act(Float8Tensor(x8, x.scale_inv, BF16), Float8Tensor(w8, w.scale_inv, BF16),
                                     bias, BF16, "gelu", quantizer, transpose=False, gelu_epilogue=True)
        linear_ops.fp8_wgrad_accumulate(dy_t, dy.scale_inv, x_t, x.scale_inv, main_grad,
                                        kernels=not torch.compiler.is_compiling())
        return h, y.data.view(torch.uint8), y.scale_inv

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        state = ScalingState(mlp_ops.MLP_ROLES, device="cuda")
        state.scale[3] = 100.0
        quantizer = get_quantizers(state, FP8Context(DelayedScaling(amax_history_len=4)))[1].input
        quantizer.kernels = fn is step  # the backend get_quantizers picks in eager code; inside a trace: False
        main_grad = torch.ones(512, 256, device="cuda")
        results.append((*fn(quantizer, main_grad, x.data, w.data, dy_t, x_t), state.amax_history[3].clone(),
                        main_grad))
    assert len(gelu_calls) == 2 and len(acc_calls) == 2, (len(gelu_calls), len(acc_calls))
    for name, a, b in zip(("h", "y8", "scale_inv", "amax", "main_grad"), *results):
        assert torch.equal(a, b), name
