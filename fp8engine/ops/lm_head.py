"""The LM head fused with the cross-entropy: ``loss = mean_t CE(hidden[t] @ W.T, target[t])`` without the
``[tokens, vocab]`` logits, their fp32 copy or their gradient ever existing whole.

The tokens are cut into chunks of ``chunk_size`` rows. Per chunk, in forward (Liger-Kernel's
``fused_linear_cross_entropy`` scheme, here in plain PyTorch):

- fprop: ``z = h_c @ W.T`` ``[c, V]`` in the compute dtype, then in float32: ``m = max_v z``,
  ``s = sum_v exp(z - m)``, ``loss_t = log s - (z[t, y_t] - m)`` (the log-sum-exp form of Megatron-core's
  ``vocab_parallel_cross_entropy``);
- the logits gradient ``dz = (softmax(z) - onehot(y)) / n_valid`` (float32, then the compute dtype);
- dgrad: ``dh_c = dz @ W`` ``[c, h]``; wgrad: ``dW += dz.T @ h_c`` ``[V, h]`` (accumulated in float32).

The float32 steps are two functions of :mod:`fp8engine.kernels.cross_entropy` (row statistics, then the logits
gradient). Where :func:`~fp8engine.fp8.float8_tensor.use_kernels` holds (CUDA, eager or CUDA graph) they run as
its two Triton kernels over the GEMM's 16-bit logits (6 bytes moved per logit where the plain chain moves ~54), the
chunks are 4x larger and the wgrad GEMM adds into the fp32 ``dW`` in its epilogue. Under ``torch.compile`` and on
CPU their plain-PyTorch references run (Inductor fuses them itself).

Backward then only multiplies ``dh`` and ``dW`` by the incoming scalar gradient. Peak extra memory: one chunk's
logits plus ``dh`` and a float32 ``dW``.

Vocabulary-parallel form (:mod:`fp8engine.parallel.lm_head_loss`): ``W`` is this rank's vocabulary shard starting at
row ``vocab_start`` and a ``reduce(t, op)`` callback all-reduces the per-row max (``op="max"``) and the stacked
(target logit, sum-exp) pair (``op="sum"``) over the tensor-parallel group; ``dh`` is then this shard's partial sum,
reduced by the region mapping the caller put in front of ``hidden``. This file never talks to torch.distributed.

The chunk loop has a fixed trip count for given shapes and no data-dependent shape or host synchronisation, so it
runs under CUDA-graph capture and ``torch.compile`` (which unrolls it).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from fp8engine.fp8.quantizer import call_kernels
from fp8engine.kernels import cross_entropy as ce

__all__ = ["fused_linear_cross_entropy", "lm_head_cross_entropy", "default_chunk_size", "compute_dtype",
           "LM_LOSS_BACKENDS", "IGNORE_INDEX"]

#: Backends of :func:`lm_head_cross_entropy` (``GPTConfig.lm_loss``).
LM_LOSS_BACKENDS = ("chunked", "liger", "cce", "unfused")
#: Targets equal to this are left out of the loss and of the mean's count (torch's ``cross_entropy`` default).
IGNORE_INDEX = -100
#: Logit elements per chunk that :func:`default_chunk_size` aims for: 2**26 = 64 Mi, i.e. 256 MiB per float32
#: ``[c, V]`` temporary; 1024 token rows at GPT-2's vocabulary (50304). Chosen by this arithmetic, not by a GPU sweep.
_CHUNK_ELEMENTS = 2 ** 26
#: The same with the Triton cross-entropy kernels, whose only ``[c, V]`` temporary is the GEMM's 16-bit output (its
#: gradient is written in place): 2**28 = 512 MiB of bf16 logits. Fewer chunks: fewer passes of the fp32 ``dW``
#: accumulation (one read and write of ``[V, h]`` per chunk) and larger GEMMs.
_KERNEL_CHUNK_ELEMENTS = 2 ** 28
#: Fewest rows per chunk (FP8/tensor-core friendly multiple of 16).
_MIN_CHUNK_ROWS = 16
#: cut-cross-entropy's gradient filter: None computes every logit's gradient (the same gradient as the other
#: backends); the library's "high" skips softmax entries below bf16 resolution (faster, approximate).
_CCE_FILTER_EPS = None

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
#: GEMM dtypes whose chunks run the Triton cross-entropy kernels (where :func:`use_kernels` says so).
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_chunk_size(tokens: int, vocab: int, kernels: bool = False) -> int:
    """Token rows per chunk: the largest power of two with ``rows * vocab <= 2**26`` (``2**28`` with ``kernels``,
    :data:`_KERNEL_CHUNK_ELEMENTS`), at least 16, capped at ``tokens``. ``vocab`` is the local (per-rank)
    vocabulary."""
    elements = _KERNEL_CHUNK_ELEMENTS if kernels else _CHUNK_ELEMENTS
    rows = max(_MIN_CHUNK_ROWS, 1 << max(0, (elements // max(1, vocab)).bit_length() - 1))
    return max(1, min(tokens, rows))


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype, as ``F.linear(hidden, weight)`` would pick it: ``torch.autocast``'s dtype when autocast
    is on for ``hidden``'s device, else ``hidden.dtype``.

    Raises:
        TypeError: outside autocast, ``hidden`` and ``weight`` of different dtypes (``F.linear`` raises too).
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"LM head: hidden is {hidden.dtype} but the weight is {weight.dtype}; cast one of them or run "
                        "under torch.autocast")
    return hidden.dtype


def _chunk(h_c: torch.Tensor, w_c: torch.Tensor, t_c: torch.Tensor, vocab_start: int, ignore_index: int,
           reduce: Optional[Reduce], grad_scale: Optional[torch.Tensor], kernels: bool):
    """One chunk (module docstring): ``(loss_rows [c] fp32, dz [c, V_local] in w_c.dtype or None)``. ``grad_scale``:
    ``1 / n_valid`` (0-d fp32 tensor) when the gradient is wanted, else None (fp32 reads fp64 for float64 GEMMs).
    ``kernels``: the Triton kernels of :mod:`fp8engine.kernels.cross_entropy`, else their references.
    Vocabulary-parallel, the shards' row statistics (max, sum-exp, raw target logit) are combined between the two
    steps: global max, each shard's sum-exp rescaled to it, target logits summed."""
    row_stats, grad_ = (ce.ce_row_stats, ce.ce_grad_) if kernels else (ce.ce_row_stats_reference, ce.ce_grad_reference)
    z = h_c @ w_c.t()                                             # fprop [c, V_local], compute dtype
    m, sum_exp, predicted = row_stats(z, t_c, vocab_start)
    if reduce is not None:
        global_m = reduce(m.clone(), "max")  # (the callback may all-reduce in place)
        predicted, sum_exp = reduce(torch.stack([predicted, sum_exp * torch.exp(m - global_m)]), "sum")
        m = global_m
    valid = t_c != ignore_index
    loss_rows = (sum_exp.log() + m - predicted).masked_fill(~valid, 0.0)
    if grad_scale is None:
        return loss_rows, None
    row_scale = valid.to(grad_scale.dtype) * grad_scale
    return loss_rows, grad_(z, t_c, m.contiguous(), sum_exp.contiguous(), row_scale, vocab_start)


#: Per CUDA device: whether ``torch.addmm(..., out_dtype=torch.float32, out=dw)`` adds a bf16/fp16 GEMM into an fp32
#: ``dw`` in place (cuBLAS with an fp32 C and beta = 1; torch >= 2.9 on CUDA), found by one small call checked
#: against the two-step sum.
_ADDMM_FP32_OUT: dict = {}


def _addmm_fp32_out_works(device: torch.device) -> bool:
    ok = _ADDMM_FP32_OUT.get(device.index)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False  # never probe inside a capture (the graph's warm-up steps probe first)
        # values from arange, not randn: the probe must not advance the CUDA generator (it runs once per process,
        # at a different step in a resumed run than in the uninterrupted one: dropout masks would differ)
        a = (torch.arange(32 * 16, device=device, dtype=torch.float32).reshape(32, 16) % 7 - 3).bfloat16()
        b = (torch.arange(16 * 24, device=device, dtype=torch.float32).reshape(16, 24) % 5 - 2).bfloat16()
        acc = torch.arange(32 * 24, device=device, dtype=torch.float32).reshape(32, 24) / 64
        want = acc + (a.float() @ b.float())
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.equal(acc, want))  # small integers and /64: exact in fp32
        except (RuntimeError, TypeError):
            ok = False
        _ADDMM_FP32_OUT[device.index] = ok
    return ok


def _accumulate_wgrad(dw: torch.Tensor, dz: torch.Tensor, h_c: torch.Tensor) -> None:
    """``dw += dz.T @ h_c`` (``dw [V, h]`` float32/64, ``dz``/``h_c`` in the compute dtype): in the GEMM's epilogue
    on CUDA where :func:`_addmm_fp32_out_works`, else through a compute-dtype product (one more pass over ``dw``)."""
    if dz.dtype == dw.dtype:
        dw.addmm_(dz.t(), h_c)
    elif dw.is_cuda and not torch.compiler.is_compiling() and _addmm_fp32_out_works(dw.device):
        torch.addmm(dw, dz.t(), h_c, out_dtype=dw.dtype, out=dw)
    else:
        dw.add_(dz.t() @ h_c)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Module docstring. Inputs: ``hidden [T, h]``, ``weight [V_local, h]``, ``target [T]``; returns the 0-d fp32
    mean loss. fprop/dgrad/wgrad all run in forward; backward scales the saved ``dh``, ``dW``."""

    @staticmethod
    def forward(ctx, hidden, weight, target, dtype, chunk_size, vocab_start, ignore_index, reduce, need_dh, need_dw,
                kernels):
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            w = weight.to(dtype)
            stats = torch.promote_types(dtype, torch.float32)  # float64 for float64 GEMMs (the tests' reference)
            valid_count = (target != ignore_index).sum().to(stats)
            grad_scale = 1.0 / valid_count if (need_dh or need_dw) else None
            dw = torch.zeros(w.shape, dtype=stats, device=w.device) if need_dw else None
            losses, dhs = [], []
            for start in range(0, h.shape[0], chunk_size):
                h_c, t_c = h[start:start + chunk_size], target[start:start + chunk_size]
                loss_rows, dz = _chunk(h_c, w, t_c, vocab_start, ignore_index, reduce, grad_scale, kernels)
                losses.append(loss_rows)
                if need_dh:
                    dhs.append(dz @ w)                            # dgrad [c, h]
                if need_dw:
                    _accumulate_wgrad(dw, dz, h_c)                # wgrad [V_local, h]
            loss = torch.cat(losses).sum() / valid_count
        ctx.save_for_backward(torch.cat(dhs).to(hidden.dtype) if need_dh else None,
                              dw.to(weight.dtype) if need_dw else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = (None if t is None else t * grad_loss.to(t.dtype) for t in ctx.saved_tensors)
        return dh, dw, None, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = IGNORE_INDEX, chunk_size: Optional[int] = None,
                               vocab_start: int = 0, reduce: Optional[Reduce] = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` over the tokens whose target is not ``ignore_index``,
    computed chunk by chunk (module docstring); the same value and gradients as
    ``F.cross_entropy(F.linear(hidden, weight).float(), target)`` up to float32 summation order.

    Args:
        hidden: ``[*, h]`` float32/bf16/fp16 (the final norm's output).
        weight: ``[V_local, h]`` (the whole vocabulary, or with ``reduce`` this rank's shard). Under
            ``torch.autocast`` both are cast to its dtype for the GEMMs (as ``F.linear``); the softmax statistics
            are float32. Gradients come back in each input's dtype.
        target: ``[*]`` int64 in ``[0, V)`` or ``ignore_index``.
        ignore_index: targets left out of the sum and of the count (the count is a device tensor: no sync; all
            targets ignored gives NaN, as torch).
        chunk_size: token rows per chunk (default :func:`default_chunk_size`); need not divide the token count.
        vocab_start: first vocabulary row of ``weight`` (``rank * V_local`` vocab-parallel).
        reduce: ``reduce(t, op)`` returning ``t`` all-reduced with ``op`` ("max" or "sum") over the vocab shards,
            or None (one shard). Supplied by :mod:`fp8engine.parallel.lm_head_loss`.
    Returns:
        0-d float32 mean loss (float64 for float64 GEMMs), identical on every rank of the group.
    Raises:
        ValueError: mismatched shapes or ``chunk_size < 1``. TypeError: as :func:`compute_dtype`.
    """
    if hidden.shape[-1] != weight.shape[-1] or hidden.shape[:-1] != target.shape:
        raise ValueError(f"fused_linear_cross_entropy needs hidden [*, h], weight [V, h], target [*]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(target.shape)}")
    hidden2d, target1d = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    dtype = compute_dtype(hidden, weight)
    kernels = dtype in _KERNEL_DTYPES and call_kernels(hidden)  # the backend of every chunk, chosen once
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden2d.shape[0], weight.shape[0], kernels)
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    grad = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(hidden2d, weight, target1d, dtype, chunk_size, vocab_start, ignore_index,
                                          reduce, grad and hidden.requires_grad, grad and weight.requires_grad, kernels)


def _library_loss(backend: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                  ignore_index: int) -> torch.Tensor:
    """liger-kernel's or cut-cross-entropy's fused loss (Triton, CUDA only); both operands in the compute dtype."""
    if hidden.device.type != "cuda":
        raise RuntimeError(f"lm_loss={backend!r} runs Triton kernels on CUDA only; the hidden states are on "
                           f"{hidden.device.type}: use lm_loss='chunked' (the plain-PyTorch fused loss)")
    try:
        if backend == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fn
        else:
            from cut_cross_entropy import linear_cross_entropy as fn
    except ImportError as err:
        package = "liger-kernel" if backend == "liger" else "cut-cross-entropy"
        raise RuntimeError(f"lm_loss={backend!r} needs the {package} package ({err}); install it with "
                           f"`pip install {package}` (or fp8engine[lm-loss]), or use lm_loss='chunked'") from err
    dtype = compute_dtype(hidden, weight)
    h, w, t = hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype), target.reshape(-1)
    with torch.autocast("cuda", enabled=False):
        if backend == "liger":
            return fn(h, w, t, ignore_index=ignore_index, reduction="mean").float()
        return fn(h, w, t, ignore_index=ignore_index, reduction="mean", filter_eps=_CCE_FILTER_EPS).float()


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, backend: str = "chunked",
                          *, ignore_index: int = IGNORE_INDEX, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (one rank, the whole vocabulary) by ``backend``:

    - ``"chunked"``: :func:`fused_linear_cross_entropy` (plain PyTorch, any device, CUDA graphs, torch.compile);
    - ``"liger"``: ``liger_kernel``'s ``liger_fused_linear_cross_entropy`` (Triton; its forward reads the valid
      count with ``.item()``, a host sync: not CUDA-graph capturable);
    - ``"cce"``: ``cut_cross_entropy.linear_cross_entropy`` (Apple's Cut Cross-Entropy, Triton), with every
      gradient computed (``filter_eps=None``); its forward finds the valid tokens with ``nonzero()`` (a host sync
      and a data-dependent shape: not CUDA-graph capturable either);
    - ``"unfused"``: ``F.cross_entropy(F.linear(hidden, weight).float(), target)``, the reference.

    Shapes as :func:`fused_linear_cross_entropy`; returns a 0-d float32 loss.

    Raises:
        ValueError: unknown ``backend`` (the message lists :data:`LM_LOSS_BACKENDS`).
        RuntimeError: ``"liger"``/``"cce"`` on a non-CUDA tensor or with the package not installed (checked at each
            call, before any work; the message names the fix). No silent fallback.
    """
    if backend == "chunked":
        return fused_linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index, chunk_size=chunk_size)
    if backend == "unfused":
        logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=ignore_index)
    if backend in ("liger", "cce"):
        return _library_loss(backend, hidden, weight, target, ignore_index)
    raise ValueError(f"unknown LM loss backend {backend!r}; choose one of {', '.join(LM_LOSS_BACKENDS)}")
