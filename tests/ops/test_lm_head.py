"""The fused, chunked LM head + cross-entropy (fp8engine.ops.lm_head) against the unfused loss computed in float64:
loss, input gradient and weight gradient; odd token counts, chunk sizes that do not divide them, ignored targets,
bf16 autocast, grad-less calls, torch.compile, and the backend dispatch."""
import pytest
import torch
import torch.nn.functional as F

from fp8engine.ops.lm_head import (IGNORE_INDEX, LM_LOSS_BACKENDS, default_chunk_size, fused_linear_cross_entropy,
                                   lm_head_cross_entropy)
from fp8engine.fp8.float8_tensor import kernels_forced
from tests.conftest import sqnr

T, H, V = 1151, 48, 97  # odd token count and vocabulary


def _inputs(tokens=T, hidden=H, vocab=V, dtype=torch.float32, ignore_every=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.3  # logits of std ~2: a peaked softmax
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignore_every:
        t[::ignore_every] = IGNORE_INDEX
    return x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), t


def _reference(x, w, t):
    """The unfused loss in float64 and its gradients."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss = F.cross_entropy(x64 @ w64.t(), t, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), x64.grad, w64.grad


def _close(actual, ref, rel):
    """Every element within ``rel`` of the reference's largest magnitude: the gradient elements are sums over tokens
    of terms of both signs, so single elements may cancel to far below the float32 rounding of their terms."""
    err, scale = (actual.double() - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x max |ref| {scale:.3g}"


def _fused(x, w, t, **kw):
    loss = fused_linear_cross_entropy(x, w, t, **kw)
    dx, dw = torch.autograd.grad(loss, (x, w))
    return loss.detach(), dx, dw


@pytest.mark.parametrize("chunk_size", [None, 100, 1, T])  # one chunk, a non-divisor, single rows, exact fit
@pytest.mark.parametrize("ignore_every", [0, 7])
def test_fp32_matches_float64_reference(chunk_size, ignore_every):
    x, w, t = _inputs(ignore_every=ignore_every)
    ref = _reference(x, w, t)
    got = _fused(x, w, t, chunk_size=chunk_size)
    assert got[0].dtype == torch.float32
    # float32 GEMMs of 48-term dot products and a 97-term sum-exp: relative errors ~1e-6 (a few float32 ulps); the
    # loss is a mean of 1151 terms (|loss| ~ 5); dW sums up to 1151 tokens' terms: 1e-5 of its largest element.
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-6, atol=1e-6)
    _close(got[1], ref[1], 1e-5)
    _close(got[2], ref[2], 1e-5)


def test_float64_is_the_reference_to_rounding():
    """In float64 the chunked loss is the unfused loss up to float64 summation order."""
    x, w, t = _inputs(dtype=torch.float64, ignore_every=5)
    ref, got = _reference(x, w, t), _fused(x, w, t, chunk_size=128)
    assert got[0].dtype == torch.float64
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_bf16_autocast_matches_bf16_reference():
    """Under torch.autocast(bf16) with float32 parameters, the GEMMs run in bf16 and the statistics in float32: the
    same math as ``F.cross_entropy(F.linear(x, w).float(), t)`` under autocast. Both are compared with the float64
    reference; the chunked loss may differ from the bf16 reference by bf16 rounding of the GEMM outputs, and its
    float32-accumulated weight gradient is at least as accurate (SQNR within 1 dB)."""
    x, w, t = _inputs()
    xb = x.detach().bfloat16().requires_grad_()  # the residual stream in the autocast dtype, as in the GPT
    ref64 = _reference(xb, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _fused(xb, w, t, chunk_size=100)
        ref_loss = F.cross_entropy(F.linear(xb, w).float(), t)
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (xb, w)))
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32  # gradients in the inputs' dtypes
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)  # bf16 logits (8 bits), averaged over tokens
    for i in (1, 2):
        assert sqnr(ref64[i], got[i]) >= sqnr(ref64[i], ref[i]) - 1.0
        assert sqnr(ref64[i], got[i]) >= 30  # bf16 operands: ~40 dB per element, better summed


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_kernel_path_matches_the_plain_path(bf16):
    """The chunks' statistics and logits gradient by the Triton kernels (what CUDA runs; interpreted here) against
    the plain-PyTorch chunks and the float64 reference: fp32 within the plain path's bound; under bf16 autocast the
    kernels round the logits gradient to bf16 once, as the plain path does (SQNR within 1 dB of it)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU both calls run the compiled kernels
    x, w, t = (a.detach().to(dev) for a in _inputs(tokens=301, ignore_every=7))
    x, w = (x.bfloat16() if bf16 else x).requires_grad_(), w.requires_grad_()
    ref64 = _reference(x, w, t)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
        plain = _fused(x, w, t, chunk_size=64)
        with kernels_forced():
            got = _fused(x, w, t, chunk_size=64)
    assert [g.dtype for g in got] == [g.dtype for g in plain]
    if not bf16:
        torch.testing.assert_close(got[0].double(), ref64[0], rtol=1e-6, atol=1e-6)
        _close(got[1], ref64[1], 1e-5)
        _close(got[2], ref64[2], 1e-5)
        return
    torch.testing.assert_close(got[0], plain[0], rtol=1e-5, atol=1e-5)  # fp32 statistics of the same bf16 logits
    for i in (1, 2):
        assert sqnr(ref64[i], got[i]) >= sqnr(ref64[i], plain[i]) - 1.0


def test_only_the_needed_gradients_and_no_grad():
    x, w, t = _inputs(tokens=131)
    ref = _reference(x, w, t)
    w_frozen = w.detach()
    loss = fused_linear_cross_entropy(x, w_frozen, t, chunk_size=50)
    (dx,) = torch.autograd.grad(loss, (x,))
    _close(dx, ref[1], 1e-5)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        loss = fused_linear_cross_entropy(x, w, t, chunk_size=50)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), ref[0], rtol=1e-6, atol=1e-6)


def test_backward_scales_by_the_incoming_gradient():
    x, w, t = _inputs(tokens=64)
    (3.5 * fused_linear_cross_entropy(x, w, t, chunk_size=16)).backward()
    ref = _reference(x, w, t)
    _close(x.grad, 3.5 * ref[1], 1e-5)
    _close(w.grad, 3.5 * ref[2], 1e-5)


def test_leading_dims_and_errors():
    x, w, t = _inputs(tokens=60)
    loss = fused_linear_cross_entropy(x.reshape(5, 12, H), w, t.reshape(5, 12), chunk_size=7)
    torch.testing.assert_close(loss.double(), _reference(x, w, t)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(x, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="target"):
        fused_linear_cross_entropy(x, w, t[:-1])
    with pytest.raises(TypeError, match="autocast"):
        fused_linear_cross_entropy(x, w.double(), t)


def test_default_chunk_size():
    assert default_chunk_size(16 * 1024, 50304) == 1024  # GPT-2 vocabulary: 16 chunks of a 16 x 1024 batch
    assert default_chunk_size(16 * 1024, 128256) == 512
    assert default_chunk_size(16 * 128, 256) == 16 * 128  # byte vocabulary: one chunk
    assert default_chunk_size(3, 50304) == 3
    assert default_chunk_size(16 * 1024, 50304, kernels=True) == 4096  # kernels: 2**28 bf16 logits per chunk


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_compiled_matches_eager(bf16):
    """Dynamo traces the chunk loop as one graph (fullgraph: no graph break, no host sync) through AOTAutograd
    (``aot_eager``: ~2 s on CPU; Inductor's CPU compile of the unrolled loop takes ~25 s, see the slow test), also
    with torch.autocast around it."""
    x, w, t = _inputs(tokens=67, vocab=48)
    if bf16:
        x = x.detach().bfloat16().requires_grad_()

    def loss(a, b, c):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return fused_linear_cross_entropy(a, b, c, chunk_size=16)

    eager = _fused_with(loss, x, w, t)
    fn = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled = _fused_with(fn, x, w, t)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_compiled_matches_reference():
    torch._dynamo.reset()
    x, w, t = _inputs(tokens=67, vocab=48)
    fn = torch.compile(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=32), fullgraph=True)
    got, ref = _fused_with(fn, x, w, t), _reference(x, w, t)
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-6, atol=1e-6)
    for i in (1, 2):
        _close(got[i], ref[i], 1e-5)


def _fused_with(fn, x, w, t):
    loss = fn(x, w, t)
    return (loss.detach(), *torch.autograd.grad(loss, (x, w)))


def test_backends():
    x, w, t = _inputs(tokens=40)
    unfused = lm_head_cross_entropy(x, w, t, "unfused")
    torch.testing.assert_close(unfused, F.cross_entropy(x @ w.t(), t), rtol=0, atol=0)
    torch.testing.assert_close(lm_head_cross_entropy(x, w, t), unfused, rtol=1e-6, atol=1e-6)
    assert LM_LOSS_BACKENDS == ("chunked", "liger", "cce", "unfused")
    with pytest.raises(ValueError, match="chunked, liger, cce, unfused"):
        lm_head_cross_entropy(x, w, t, "triton")
    for backend in ("liger", "cce"):  # Triton libraries: CUDA only, never a silent fallback
        if x.device.type != "cuda":
            with pytest.raises(RuntimeError, match="lm_loss='chunked'"):
                lm_head_cross_entropy(x, w, t, backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel / cut-cross-entropy run on CUDA only")
@pytest.mark.parametrize("backend", ["liger", "cce"])
def test_library_backends_match_chunked_on_cuda(backend):
    pytest.importorskip("liger_kernel" if backend == "liger" else "cut_cross_entropy")
    x, w, t = (a.cuda() for a in _inputs(tokens=1151, hidden=64, vocab=160, ignore_every=9))
    x, w = x.detach().bfloat16().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _fused(x, w, t)
        loss = lm_head_cross_entropy(x, w, t, backend)
    got = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=2e-3)  # bf16 GEMMs, different tilings
    for i in (1, 2):
        assert sqnr(ref[i], got[i]) >= 25
