"""TransformerLayer: plain-PyTorch reference, FP8 SQNR, dropout, weight caching, wgrad fusion, and tensor/sequence
parallelism on 2 gloo ranks against the unsharded layer built from the same seed."""
import os
import sys
from pathlib import Path

import pytest
import torch

import fp8engine
from tests.conftest import sqnr
from fp8engine.modules import RotaryEmbedding, TransformerLayer
from fp8engine.modules.attention import AttentionConfig
from test_attention import reference_attention
from test_layernorm_mlp import reference_mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_harness import run_ranks  # noqa: E402

H, FFN, HEADS = 64, 128, 4


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    return TransformerLayer(H, FFN, HEADS, **kw)


def reference_layer(layer, x, rope=None):
    """Pre-LN block from the reference attention and MLP, in x's dtype; returns (y, params)."""
    p = {n: t.detach().to(x.dtype).requires_grad_() for n, t in layer.named_parameters()}
    attn_p = {n[len("self_attention."):]: t for n, t in p.items() if n.startswith("self_attention.")}
    h = x + reference_attention(layer.self_attention, x, attn_p, layer.self_attention.config.attn_mask_type,
                                rope=rope)
    mlp_p = {n[len("layernorm_mlp."):]: t for n, t in p.items() if n.startswith("layernorm_mlp.")}
    out = h + reference_mlp(layer.layernorm_mlp, h, p=mlp_p)[0]
    return out, p


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("groups", [4, 2])
def test_matches_reference_outside_autocast(activation, groups):
    layer = _layer(activation=activation, num_gqa_groups=groups)
    x = torch.randn(7, 3, H, requires_grad=True)
    rope = RotaryEmbedding(H // HEADS)(7)
    y = layer(x, rotary_pos_emb=rope)
    x_ref = x.detach().double().requires_grad_()
    y_ref, p = reference_layer(layer, x_ref, rope)
    torch.testing.assert_close(y, y_ref.float(), rtol=1e-5, atol=1e-5)  # fp32 vs float64 rounding
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g.double())
    torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-4, atol=1e-5)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, p[name].grad.float(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("recipe", [fp8engine.DelayedScaling(), fp8engine.CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_sqnr(recipe):
    layer = _layer(num_gqa_groups=2, activation="swiglu")
    x = torch.randn(9, 3, H, requires_grad=True)
    for _ in range(2):
        x.grad = None
        layer.zero_grad()
        with fp8engine.autocast(recipe=recipe):
            y = layer(x)
        g = torch.randn_like(y)
        y.backward(g)
    x_ref = x.detach().double().requires_grad_()
    y_ref, p = reference_layer(layer, x_ref)
    y_ref.backward(g.double())
    # torchao's >= 18 dB for outputs and the GEMM weights' grads; grads behind two E5M2 dgrads (norm params): 15
    assert sqnr(y_ref, y) >= 18
    assert sqnr(x_ref.grad, x.grad) >= 18  # the residual path carries most of dx
    for name, param in layer.named_parameters():
        assert sqnr(p[name].grad, param.grad) >= (15 if "layer_norm" in name else 18), name


def test_dropout_determinism():
    layer = _layer(hidden_dropout=0.3, attention_dropout=0.3)
    x = torch.randn(5, 3, H)
    torch.manual_seed(7)
    a = layer(x)
    torch.manual_seed(7)
    b = layer(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # dropout on, same seed: same masks
    assert not torch.allclose(a, layer(x))
    layer.eval()  # dropout off: deterministic without seeding
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)
    assert not torch.allclose(a, layer(x))


def test_weight_caching_matches_no_caching():
    layer = _layer(num_gqa_groups=2)
    xs = [torch.randn(5, 3, H) for _ in range(3)]
    with torch.no_grad(), fp8engine.autocast(recipe=fp8engine.CurrentScaling()):
        plain = [layer(x) for x in xs]
        cached = [layer(x, is_first_microbatch=i == 0) for i, x in enumerate(xs)]
    for a, b in zip(plain, cached):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation(fp8):
    fused, plain = _layer(fuse_wgrad_accumulation=True), _layer()
    gemm_weights = ["self_attention.layernorm_qkv.weight", "self_attention.proj.weight", "layernorm_mlp.fc1_weight",
                    "layernorm_mlp.fc2_weight"]
    params = dict(fused.named_parameters())
    for name in gemm_weights:
        params[name].main_grad = torch.zeros_like(params[name], dtype=torch.float32)
    x, g = torch.randn(7, 3, H), torch.randn(7, 3, H)
    for layer in (fused, plain):
        with fp8engine.autocast(enabled=fp8, recipe=fp8engine.CurrentScaling()):
            y = layer(x)
        y.backward(g)
    plain_params = dict(plain.named_parameters())
    for name in gemm_weights:
        assert params[name].grad is None
        torch.testing.assert_close(params[name].main_grad, plain_params[name].grad, rtol=0, atol=0, msg=name)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divide hidden_size"):
        TransformerLayer(64, 128, 6)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        TransformerLayer(64, 128, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="activation"):
        TransformerLayer(64, 128, 4, activation="silu")
    with pytest.raises(ValueError, match="normalization"):
        TransformerLayer(64, 128, 4, normalization="BatchNorm")
    with pytest.raises(ValueError, match="self_attn_mask_type|attn_mask_type"):
        TransformerLayer(64, 128, 4, self_attn_mask_type="causal_bottom_right")  # not implemented
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        AttentionConfig(96, 6, 2, "causal", tp_size=3)  # groups=2 not divisible by tp=3
    with pytest.raises(ValueError, match="hidden_dropout"):
        TransformerLayer(64, 128, 4, hidden_dropout=1.0)


# --------------------------------------------------------------------------------------------------------------
# Tensor parallel: 2 ranks, tp=2, compared with the tp=1 layer built from the same seed.

_COLUMN = {"self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias", "layernorm_mlp.fc1_weight",
           "layernorm_mlp.fc1_bias"}
_ROW = {"self_attention.proj.weight", "layernorm_mlp.fc2_weight"}


def _ref_slice(name, t, rank, tp):
    if name in _COLUMN:
        segments = 2 if name.startswith("layernorm_mlp.fc1") else 1  # swiglu: [gate | up] sharded separately
        return torch.cat([seg.chunk(tp, 0)[rank] for seg in t.chunk(segments, 0)], 0)
    if name in _ROW:
        return t.chunk(tp, 1)[rank]
    return t


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    group = dist.group.WORLD
    for sp in (False, True):
        for fp8 in (False, True):
            kw = dict(num_gqa_groups=2, activation="swiglu")
            ref = _layer(**kw)
            tp = _layer(tp_group=group, set_parallel_mode=True, sequence_parallel=sp, **kw)
            ref_p, tp_p = dict(ref.named_parameters()), dict(tp.named_parameters())
            for name, p in tp_p.items():  # the same seed gives the slices of the unsharded layer
                torch.testing.assert_close(p, _ref_slice(name, ref_p[name], rank, world_size), rtol=0, atol=0)
            torch.manual_seed(1)
            x, g = torch.randn(8, 3, H), torch.randn(8, 3, H)
            rope = RotaryEmbedding(H // HEADS)(8)
            x_ref = x.clone().requires_grad_()
            y_ref = ref(x_ref, rotary_pos_emb=rope)  # fp32 unsharded reference
            y_ref.backward(g)
            x_loc = (x.chunk(world_size, 0)[rank] if sp else x).clone().requires_grad_()
            with fp8engine.autocast(enabled=fp8, recipe=fp8engine.CurrentScaling()):
                y = tp(x_loc, rotary_pos_emb=rope)
            y.backward(g.chunk(world_size, 0)[rank] if sp else g)
            want_y = y_ref.chunk(world_size, 0)[rank] if sp else y_ref
            want_dx = x_ref.grad.chunk(world_size, 0)[rank] if sp else x_ref.grad
            what = f"sp={sp} fp8={fp8} rank={rank}"
            grads = {}
            for name, p in tp_p.items():
                grad = p.grad.clone()
                if getattr(p, "sequence_parallel", False):  # partial per sequence shard: sum over tp ranks
                    dist.all_reduce(grad, group=group)
                grads[name] = grad
            if not fp8:  # same math, different summation order across ranks: fp32 rounding only
                torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5, msg=what)
                torch.testing.assert_close(x_loc.grad, want_dx, rtol=1e-4, atol=1e-5, msg=what)
                for name, grad in grads.items():
                    want = _ref_slice(name, ref_p[name].grad, rank, world_size)
                    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5, msg=f"{name} {what}")
            else:  # FP8 TP vs fp32 unsharded: torchao's 18 dB for outputs/GEMM grads, 15 behind two E5M2 dgrads
                assert sqnr(want_y, y) >= 18, what
                assert sqnr(want_dx, x_loc.grad) >= 18, what
                for name, grad in grads.items():
                    want = _ref_slice(name, ref_p[name].grad, rank, world_size)
                    assert sqnr(want, grad) >= (15 if "layer_norm" in name else 18), f"{name} {what}"


@pytest.mark.slow
def test_tensor_parallel_matches_unsharded():
    run_ranks(_tp_worker, 2)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
def test_fp32_input_under_bf16_autocast(backend):
    """The layer as a user of ``torch.autocast`` calls it: fp32 input (the residual stream) and bf16 branches. The
    MLP's norm adds the bf16 attention output to the fp32 residual: promoted to fp32 as ``x + residual`` would be
    (the norm kernels once refused the pair on CUDA). Output fp32, within FP8 + bf16 error of float64."""
    from fp8engine.fp8.float8_tensor import kernels_forced
    from fp8engine.kernels import kernels_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "kernels" and device == "cpu" and not (os.environ.get("TRITON_INTERPRET") == "1"
                                                         and kernels_available("cpu")):
        pytest.skip("the kernel backend on CPU needs Triton with TRITON_INTERPRET=1")
    layer = _layer(num_gqa_groups=2).to(device)
    x = torch.randn(32, 2, H, device=device, requires_grad=True)
    with kernels_forced(backend == "kernels" and device == "cpu"):
        with torch.autocast(device, dtype=torch.bfloat16), fp8engine.autocast():
            y = layer(x)
        assert y.dtype == torch.float32
        g = torch.randn_like(y)
        y.backward(g)
    x_ref = x.detach().cpu().double().requires_grad_()
    y_ref, _ = reference_layer(layer.cpu(), x_ref)
    y_ref.backward(g.cpu().double())
    # bf16 branches (8-bit mantissa) plus FP8 GEMMs: the 18 dB of test_fp8_sqnr; the residual path is fp32
    assert sqnr(y_ref, y.cpu()) >= 18
    assert sqnr(x_ref.grad, x.grad.cpu()) >= 18
