"""A whole FP8 ``TransformerLayer`` step as one autograd node: the eager fast path of
:class:`fp8engine.modules.TransformerLayer` under per-tensor scaling (delayed or current).

Why: in eager mode a small layer's step time is its host time, and the composed layer pays it per sublayer (four FP8
autograd nodes, autograd's nodes for the q/k/v views, permutes and rotary embedding, four module calls). This op
issues the same kernels and GEMMs through the same functions (:func:`~fp8engine.ops.norm_linear.norm_fwd`,
:func:`~fp8engine.ops.gemm.fp8_fprop`, :func:`~fp8engine.ops.mlp.fc1_fprop_act`,
:func:`~fp8engine.ops.linear.dgrad_wgrad`, ...) from one forward and one backward, so it computes exactly what the
composed layer computes: on CPU the same bits (tests compare them), on a GPU the same kernels in the same order,
except the rotary embedding, whose kernels give the reference's bits.

Forward (``[s, b, h]`` in, out; TransformerEngine's GEMM names):

1. ``ln1 = norm1(x)`` written in FP8 by the norm kernel -> QKV fprop ``qkv = ln1 @ Wqkv.T + bqkv``;
2. q, k, v: views of ``qkv`` in the grouped layout (:mod:`fp8engine.ops.qkv`), q and k rotated
   (:func:`fp8engine.ops.qkv.split_rotate`); attention by the backend SDPA picks: for cuDNN and flash its ATen ops
   called directly, forward and backward (:mod:`fp8engine.ops.sdpa`); otherwise (dropout, GQA, other backends)
   SDPA as its own autograd node, replayed in backward;
3. the attention output cast to FP8 -> proj fprop ``a = ctx @ Wproj.T + bproj``;
4. ``s2 = a + x`` and ``ln2 = norm2(s2)`` in one norm kernel, written in FP8 -> fc1 fprop (with the GELU epilogue
   where it applies) -> activation in FP8 -> fc2 fprop ``m``; the output is ``s2 + m``.

Backward runs the same steps in reverse: fc2 / fc1 (:func:`~fp8engine.ops.mlp.act_bwd_cast` between), norm2's
backward with the residual gradient added in the kernel, proj's dgrad / wgrad, attention backward, the QKV gradient
cast straight from dq, dk, dv with the rotary backward inside (:func:`fp8engine.ops.qkv.qkv_grad_fp8`) and its dgrad /
wgrad, and norm1's backward with the gradient of the residual branch added.

Hidden dropout (training) runs ``F.dropout`` on the attention and MLP branches where the composed layer does, in the
same order (so the same masks), each as its own small autograd node replayed in backward, as SDPA's.

Replay (:mod:`fp8engine.ops.replay`): with grad enabled, the first call of each configuration (:func:`_replay_config`,
:func:`_dispatch_state` and every input tensor's shape, strides, dtype and alignment) runs the Python below under a
recorder, forward and backward; later calls run the recorded ops as one generated function each: the same ops on the
new tensors, bit-equal (``tests/ops/test_replay.py``). Not replayed: dropout, GQA (SDPA keeps its node),
``fuse_wgrad_accumulation``, FP8 statistics recording. ``FP8ENGINE_REPLAY=0`` (read at import) or ``REPLAY = False``
turns it off.

Autograd: ``retain_graph=True`` keeps everything the backward reads, so another backward gives the same gradients
(and records the same amaxes); without it each saved tensor is dropped once used and a second backward raises
PyTorch's "Trying to backward through the graph a second time" -- on the replayed step too. ``create_graph=True``
raises a RuntimeError (:func:`~fp8engine.ops.backward.backward_keeps_graph`).

Not covered (``TransformerLayer._fused_plan`` returns None and the layer runs its composed sublayers): block
scaling, tensor / sequence parallelism, ``torch.compile`` tracing, a padding mask, an input whose dtype is not the
``torch.autocast`` dtype, separate q / k / v weights or a layer without input norm, ``return_layernorm_output``,
the unfused MLP (``LayerNormMLP.fused=False``).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from fp8engine.ops import gemm as gemm_path
from fp8engine.ops import replay, replay_cache
from fp8engine.ops.backward import backward_keeps_graph
from fp8engine.ops.gemm import fp8_fprop
from fp8engine.ops.linear import dgrad_wgrad
from fp8engine.ops.mlp import act_bwd_cast, fc1_fprop_act
from fp8engine.ops.norm_linear import norm_bwd, norm_fwd
from fp8engine.ops.qkv import qkv_grad_fp8, split_rotate
from fp8engine.ops.sdpa import sdpa_bwd, sdpa_fwd

__all__ = ["fused_layer", "LayerPlan"]

_STEP = "the fused FP8 TransformerLayer step"  # (how errors name it)


class LayerPlan:
    """The non-tensor arguments of one fused layer call (built by the layer for each call).

    Attributes: ``qkv``, ``proj``, ``fc1``, ``fc2``: the GEMMs' :class:`~fp8engine.fp8.quantizer.LinearQuantizers`;
    ``w_fp8``: the four FP8 weights ``(Wqkv, Wproj, W1, W2)`` (weight cache included), or None:
    the step casts them itself (no weight caching, grad enabled); ``split``: ``(g, hpg, d)``
    per rank; ``rope``: rotary angles ``[s, 1, 1, r]`` or None; ``attn``: keyword arguments of the attention call
    (mask, dropout, causal, GQA); ``rng``: context manager factory for attention dropout (or None); ``norm1`` /
    ``norm2``: ``(eps, rms, zero_centered_gamma)``; ``kind``: the activation; ``fuse_wgrad``; ``gelu_epilogue``;
    ``hidden_dropout``: the probability applied to each branch before its residual add (0.0: none); ``replay``:
    set by :func:`fused_layer` (the non-tensor part of the replay key, or None: not recorded or replayed).
    """

    __slots__ = ("qkv", "proj", "fc1", "fc2", "w_fp8", "split", "rope", "attn", "rng", "norm1", "norm2", "kind",
                 "fuse_wgrad", "gelu_epilogue", "hidden_dropout", "replay")

    def __init__(self, **kw):
        kw.setdefault("replay", None)  # set by fused_layer: the replay configuration key, or None
        for name in self.__slots__:
            setattr(self, name, kw[name])


#: ``FP8ENGINE_REPLAY=0`` turns the replay of recorded steps off (read at import).
REPLAY = os.environ.get("FP8ENGINE_REPLAY", "1") != "0"
#: replay key -> :class:`~fp8engine.ops.replay.Pair` (replayed; a ``Checked`` under ``FP8ENGINE_REPLAY=check``),
#: the number of recordings started, or the reason the configuration is not replayed (str). Process-wide and
#: bounded: :class:`~fp8engine.ops.replay_cache.ProgramCache`.
_PROGRAMS = replay_cache.ProgramCache()


class _FP8TransformerLayer(torch.autograd.Function):
    """The layer step (module docstring); inputs ``x`` and the 12 parameters (None where absent), then the plan.
    With ``p.replay`` set (:func:`fused_layer`), recorded at a configuration's first call, replayed later."""

    @staticmethod
    def forward(ctx, x, ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_w, ln2_b, w1, b1, w2, b2, p: LayerPlan):
        params = (ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_w, ln2_b, w1, b1, w2, b2)
        if p.replay is None:
            return _forward(ctx, x, params, p)
        inputs, key = _step_inputs(x, params, p)
        key = (p.replay, key, ctx.needs_input_grad)
        state = _PROGRAMS.get(key)
        if type(state) is replay.Pair:
            _PROGRAMS.move_to_end(key)  # (least recently used out first)
            (out,), saved = state.forward(inputs)
            ctx.save_for_backward(x, ln1_w, w_qkv, w_proj, ln2_w, w1, w2)  # autograd's in-place checks, as below
            ctx.replayed = (state, saved)
            return out
        if type(state) is replay_cache.Checked:  # FP8ENGINE_REPLAY=check: the replay and this Python, bits compared
            (out,), ctx.replayed = state.forward(inputs, lambda: (_forward(ctx, x, params, p),),
                                                 lambda dout: _backward(ctx, dout, backward_keeps_graph(_STEP)))
            return out
        if not _PROGRAMS.start(key):  # refused, given up, or a new configuration past the cache's miss budget
            return _forward(ctx, x, params, p)
        rec = replay.Recorder(inputs)
        with rec:
            out = _forward(ctx, x, params, p)
        try:
            ctx.recording = (key, rec, rec.template((out,)))
        except replay.RecordAbort as err:
            _PROGRAMS[key] = f"not replayed: {err}"
        return out

    @staticmethod
    def backward(ctx, dout):
        keep = backward_keeps_graph(_STEP)
        replayed, recording = getattr(ctx, "replayed", None), getattr(ctx, "recording", None)
        if (replayed is not None or recording is not None) and (
                not dout.is_contiguous() or (dout.is_cuda and dout.data_ptr() & 255)):
            # what a replay takes is what was recorded: contiguous, 256-byte aligned on a GPU (as a fresh tensor)
            dout = dout.clone(memory_format=torch.contiguous_format)
        if replayed is not None:
            # autograd's check that no saved input was modified in place; after a backward without retain_graph,
            # PyTorch's "backward through the graph a second time" error
            ctx.saved_tensors  # noqa: B018
            program, saved = replayed
            if keep:  # (the program empties the list it takes: it releases each saved tensor after its last use)
                return program.backward((dout,), list(saved))
            ctx.replayed = None
            return program.backward((dout,), saved)
        if recording is None:
            return _backward(ctx, dout, keep)
        key, frec, fout = recording
        ctx.recording = None  # (a retained graph's next backward runs the Python below on the state it kept)
        brec = replay.Recorder([dout], outer=frec)
        with brec:
            grads = _backward(ctx, dout, keep)
        try:
            _PROGRAMS[key] = replay.Pair(frec, fout, brec, brec.template(grads))
        except replay.RecordAbort as err:
            _PROGRAMS[key] = f"not replayed: {err}"
        return grads


def _step_inputs(x, params: tuple, p: LayerPlan) -> tuple[list, tuple]:
    """Every tensor the step reads that it does not make (the replay's inputs, in a fixed order; None where absent):
    ``x``, the parameters, the FP8 weights, the rotary angles, the scaling state's views; and their
    :func:`~fp8engine.ops.replay.tensor_key` s. A quantizer's views are the same tensors for its life
    (``get_quantizers`` builds new quantizers when the state's buffers change): their keys are computed once."""
    inputs = [x, *params]
    for w in p.w_fp8 or ():
        inputs += (w.data, w.scale_inv, w._data_t)
    inputs.append(p.rope)
    key = [replay.tensor_key(t) for t in inputs]
    for gemm in (p.qkv, p.proj, p.fc1, p.fc2):
        for q in gemm:
            inputs += (q.scale, q.amax)
            if q.replay_key is None:
                q.replay_key = (replay.tensor_key(q.scale), replay.tensor_key(q.amax))
            key.append(q.replay_key)
    return inputs, tuple(key)


def _replay_config(p: LayerPlan):
    """The non-tensor part of the replay key: what the step's Python branches on besides its input tensors, or
    None where the step is not replayed (dropout: its RNG draws and autograd nodes; FP8 statistics recording:
    its Python bookkeeping; ``fuse_wgrad``: the backward reads ``weight.main_grad``, which the forward's key
    cannot see)."""
    quantizers = [q for gemm in (p.qkv, p.proj, p.fc1, p.fc2) for q in gemm]
    if (p.hidden_dropout or p.attn["dropout_p"] or p.rng is not None or p.fuse_wgrad
            or any(q.stats is not None for q in quantizers)):
        return None
    return (tuple((q.fp8_dtype, q.kind, q.kernels) for q in quantizers), p.w_fp8 and tuple(w.dtype for w in p.w_fp8),
            p.split, tuple(sorted(p.attn.items())), p.norm1, p.norm2, p.kind, p.gelu_epilogue,
            gemm_path.CUBLASLT_GEMM)  # the GEMM entry fp8_mm calls (a switch the tools flip)


def _forward(ctx, x, params: tuple, p: LayerPlan) -> torch.Tensor:
    """The layer step's forward (module docstring)."""
    ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_w, ln2_b, w1, b1, w2, b2 = params
    s, b, h = x.shape
    dt = x.dtype
    if p.w_fp8 is None:  # no weight caching: the weights cast here, as FP8WeightCache.get casts them
        qs, ws = (p.qkv.weight, p.proj.weight, p.fc1.weight, p.fc2.weight), (w_qkv, w_proj, w1, w2)
        # current scaling: the four amaxes in one multi-tensor op (max |w| is exact in w's dtype: the same values
        # as each cast's own reduction would give)
        amaxes = (None,) * 4 if qs[0].delayed else torch._foreach_norm(list(ws), float("inf"))
        p.w_fp8 = tuple(q.quantize(w, transpose=True, amax=a) for q, w, a in zip(qs, ws, amaxes))
    wq8, wp8, w18, w28 = p.w_fp8
    eps1, rms1, zc1 = p.norm1
    eps2, rms2, zc2 = p.norm2
    grad = any(ctx.needs_input_grad[:13])
    x = x.contiguous()
    # 1. input norm written in FP8 (its transpose is made when wgrad needs it), QKV fprop
    _, ln1_8, mean1, rstd1, _ = norm_fwd(x, ln1_w, ln1_b, eps1, rms=rms1, zero_centered_gamma=zc1,
                                         quantizer=p.qkv.input, transpose=grad, return_hp=False,
                                         placeholder=False, kernels=p.qkv.input.kernels)
    qkv = fp8_fprop(ln1_8, wq8, dt, b_qkv)
    # backward keeps only the transposed FP8 layouts (dgrad: W^T, wgrad: X^T), made right after each GEMM and
    # the row-major copies dropped, as the composed ops do (the transients of this forward stay as small)
    keep = (lambda t: (t.transpose_2d(), t.scale_inv)) if grad else (lambda t: None)
    t_ln1, t_wq = keep(ln1_8), keep(wq8)
    del ln1_8
    # 2. attention on the grouped views (rotary: new q, k)
    g, hpg, d = p.split
    q, k, v, rope = split_rotate(qkv.view(s, b, qkv.shape[-1]), p.split, p.rope, p.qkv.input.kernels)
    q = q.reshape(s, b, g * hpg, d)
    qkv_a = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    # attn_node: (backward function, what it takes): the fused backend's ops called directly (ops.sdpa), else
    # SDPA recorded as a node
    direct = sdpa_fwd(*qkv_a, p.attn["is_causal"], p.attn["dropout_p"], p.attn["enable_gqa"], grad)
    if direct is not None:
        o, attn_node = direct[0], (_sdpa_bwd, direct[1])
    else:
        with p.rng() if p.rng is not None else contextlib.nullcontext():
            o, node = _node_fwd(lambda qa, ka, va: F.scaled_dot_product_attention(qa, ka, va, **p.attn), qkv_a, grad)
        attn_node = (_node_bwd, node)
    del qkv, q, k, v, qkv_a
    # 3. output projection
    ctx_8 = p.proj.input.quantize(o.permute(2, 0, 1, 3).reshape(s * b, g * hpg * d), transpose=grad)
    a = fp8_fprop(ctx_8, wp8, dt, b_proj)
    t_ctx, t_wp = keep(ctx_8), keep(wp8)
    del ctx_8
    a, a_drop = _dropout_fwd(a.view(s, b, h), p.hidden_dropout, grad)  # (the composed layer's order of draws)
    # 4. residual add in norm2's kernel (s2 = a + x), MLP
    _, ln2_8, mean2, rstd2, s2 = norm_fwd(a, ln2_w, ln2_b, eps2, rms=rms2, zero_centered_gamma=zc2,
                                          quantizer=p.fc1.input, transpose=grad, return_hp=False, residual=x,
                                          placeholder=False, kernels=p.fc1.input.kernels)
    del a
    hid, a8 = fc1_fprop_act(ln2_8, w18, b1, dt, p.kind, p.fc2.input, transpose=grad, gelu_epilogue=p.gelu_epilogue)
    t_ln2, t_w1 = keep(ln2_8), keep(w18)
    del ln2_8
    m = fp8_fprop(a8, w28, dt, b2)
    t_a, t_w2 = keep(a8), keep(w28)
    del a8
    p.w_fp8 = None  # the row-major FP8 weights are not needed again (the weight cache keeps its own)
    m, m_drop = _dropout_fwd(m.view(s, b, h), p.hidden_dropout, grad)
    out = s2 + m
    if grad:
        ctx.save_for_backward(x, ln1_w, w_qkv, w_proj, ln2_w, w1, w2)
        ctx.t = (t_ln1, t_wq, t_ctx, t_wp, t_ln2, t_w1, t_a, t_w2)
        ctx.attn = attn_node
        ctx.drop = (a_drop, m_drop)
        ctx.hp = (mean1, rstd1, s2, mean2, rstd2, hid, rope)
        ctx.p = p
        ctx.norm_bias = (ln1_b is not None, ln2_b is not None)
    return out


def _backward(ctx, dout, keep: bool) -> tuple:
    """The layer step's backward (module docstring): the gradients of ``x``, the 12 parameters and the plan.
    ``keep`` (:func:`backward_keeps_graph`): leave the saved state on ``ctx`` for another backward; else drop it as
    it is used."""
    x, ln1_w, w_qkv, w_proj, ln2_w, w1, w2 = ctx.saved_tensors
    p = ctx.p
    ln1_t, wq_t, ctx_t, wp_t, ln2_t, w1_t, a_t, w2_t = ctx.t
    attn_bwd, node = ctx.attn
    mean1, rstd1, s2, mean2, rstd2, hid, rope = ctx.hp
    has_ln1b, has_ln2b = ctx.norm_bias
    need = ctx.needs_input_grad  # (False for an absent bias)
    fuse = p.fuse_wgrad
    a_drop, m_drop = ctx.drop
    if not keep:
        ctx.t = ctx.attn = ctx.hp = ctx.p = ctx.drop = None
    s, b, h = dout.shape
    dout = dout.contiguous()
    # fc2, activation, fc1 (the MLP op's backward), behind the hidden dropout of the MLP branch
    dm = _dropout_bwd(m_drop, dout, keep)
    dy_8, db2 = p.fc2.grad_output.quantize_dbias(dm.view(s * b, h), transpose=True, dbias=need[12])
    del dm, m_drop
    da, dw2 = dgrad_wgrad(dy_8, w2_t, a_t, w2, fuse)
    # (each intermediate is dropped once used: autograd frees a node's buffers between the composed nodes)
    del dy_8, w2_t, a_t
    dh_8, db1 = act_bwd_cast(da, hid, p.kind, p.fc1.grad_output, transpose=True, dbias=need[10])
    del da, hid
    dln2, dw1 = dgrad_wgrad(dh_8, w1_t, ln2_t, w1, fuse)
    del dh_8, w1_t, ln2_t
    # norm2 with the residual's gradient added in the kernel: d s2 (= d a = d x through the residual)
    eps2, rms2, zc2 = p.norm2
    ds2, dln2_w, dln2_b = norm_bwd(dln2.view(s, b, h), s2, mean2, rstd2, ln2_w, rms=rms2, zero_centered_gamma=zc2,
                                   has_bias=has_ln2b, dresidual=dout, kernels=p.fc1.input.kernels)
    del dln2, s2, dout
    # output projection, behind the hidden dropout of the attention branch
    da = _dropout_bwd(a_drop, ds2, keep)
    dp_8, dbp = p.proj.grad_output.quantize_dbias(da.reshape(s * b, h), transpose=True, dbias=need[6])
    del da, a_drop
    dattn, dwp = dgrad_wgrad(dp_8, wp_t, ctx_t, w_proj, fuse)
    del dp_8, wp_t, ctx_t
    # attention's backward (the backend's backward op, or SDPA's node), the QKV gradient cast from dq, dk, dv
    g, hpg, d = p.split
    do = dattn.view(s, b, g * hpg, d).permute(1, 2, 0, 3)
    dq, dk, dv = (t.permute(2, 0, 1, 3) for t in attn_bwd(node, do, keep))
    del do, dattn
    dqkv_8, dbqkv = qkv_grad_fp8(dq.reshape(s, b, g, hpg, d), dk, dv, p.qkv.grad_output, hpg, transpose=True,
                                 dbias=need[4], rope=rope)
    del dq, dk, dv
    dln1, dwq = dgrad_wgrad(dqkv_8, wq_t, ln1_t, w_qkv, fuse)
    del dqkv_8, wq_t, ln1_t
    # input norm, with the gradient that reached x through the residual (ds2) added in the kernel
    eps1, rms1, zc1 = p.norm1
    dx, dln1_w, dln1_b = norm_bwd(dln1.view(s, b, h), x, mean1, rstd1, ln1_w, rms=rms1, zero_centered_gamma=zc1,
                                  has_bias=has_ln1b, dresidual=ds2, kernels=p.qkv.input.kernels)
    dbqkv, dbp, db1, db2 = (t if t is None or t.dtype == w.dtype else t.to(w.dtype)
                            for t, w in ((dbqkv, w_qkv), (dbp, w_proj), (db1, w1), (db2, w2)))
    return (dx, dln1_w, dln1_b if need[2] else None, dwq, dbqkv, dwp, dbp, dln2_w,
            dln2_b if need[8] else None, dw1, db1, dw2, db2, None)


def _node_fwd(fn, inputs: list, grad: bool):
    """``fn(*inputs)`` run as its own autograd node (PyTorch's own op and backward, e.g. SDPA or dropout, with its
    backend choice and RNG use unchanged), recorded when ``grad`` for :func:`_node_bwd` to replay in backward:
    ``(output, node or None)``; the output is detached (this op's output carries the layer's gradient)."""
    if not grad:
        return fn(*inputs), None
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
    return out.detach(), (out, leaves)


def _node_bwd(node, grad: torch.Tensor, keep: bool) -> tuple:
    """The gradients of a :func:`_node_fwd` node's inputs given its output's ``grad`` (``keep``: its graph kept for
    another backward)."""
    out, leaves = node
    return torch.autograd.grad(out, leaves, grad, retain_graph=keep)


def _dropout_fwd(t: torch.Tensor, prob: float, grad: bool):
    """``F.dropout(t, prob)`` where the composed layer draws it (same RNG calls, same mask) as a :func:`_node_fwd`
    node: ``(output, node or None)``; ``prob`` 0: ``(t, None)``."""
    if prob == 0.0:
        return t, None
    return _node_fwd(lambda leaf: F.dropout(leaf, prob, training=True), [t], grad)


def _dropout_bwd(node, grad: torch.Tensor, keep: bool) -> torch.Tensor:
    """The gradient through :func:`_dropout_fwd` (``node`` None: no dropout, ``grad`` itself)."""
    return grad if node is None else _node_bwd(node, grad, keep)[0]


def _sdpa_bwd(saved: tuple, do: torch.Tensor, keep: bool) -> tuple:
    """:func:`~fp8engine.ops.sdpa.sdpa_bwd` (reads its saved tensors, frees nothing) as an attention backward
    of :func:`_backward` (the signature of :func:`_node_bwd`)."""
    return sdpa_bwd(saved, do)


def fused_layer(x: torch.Tensor, params: tuple, plan: LayerPlan) -> torch.Tensor:
    """One FP8 TransformerLayer step (module docstring) as one autograd node.

    Args:
        x: ``[s, b, h]`` bf16/fp16/fp32, the layer input (dims as :class:`fp8engine.modules.TransformerLayer`).
        params: ``(ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_w, ln2_b, w1, b1, w2, b2)`` (None for an
            absent bias): the attention's input norm and fused QKV weight ``[g * (hpg + 2) * d, h]``, the output
            projection ``[h, H * d]``, the MLP's norm, ``fc1`` ``[F or 2F, h]`` and ``fc2`` ``[h, F]``.
        plan: a :class:`LayerPlan`.
    Returns:
        ``[s, b, h]`` in ``x.dtype``.
    """
    plan.replay = None
    if REPLAY and torch.is_grad_enabled():
        config = _replay_config(plan)
        plan.replay = config and (config, _dispatch_state(x))
    return _FP8TransformerLayer.apply(x, *params, plan)


def _dispatch_state(x: torch.Tensor) -> tuple:
    """The process state the ops of a step dispatch on, besides their arguments (part of the replay key):
    ``torch.autocast`` (the amax reduction runs in fp32 under it), deterministic algorithms and the switches that
    steer SDPA's backend choice (the kernels' backend is the quantizers', in :func:`_replay_config`)."""
    device = x.device.type
    cuda = torch.backends.cuda
    return (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.are_deterministic_algorithms_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())
