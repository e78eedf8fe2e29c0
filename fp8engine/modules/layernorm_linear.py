"""``LayerNormLinear``: a norm whose output feeds an FP8 GEMM (cast once, by the norm op), optionally
column-parallel; plus the small tensor-parallel helpers the other layers share.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022): a
column-parallel GEMM splits its output features over the ``tp_group`` ranks, a row-parallel GEMM its input
features (its bias is added after the reduction). ``fp8engine.parallel`` is imported only when a ``tp_group`` is
given, so the single-process path never touches ``torch.distributed``.

Under FP8 (every recipe, block scaling included) the communication runs inside the GEMM's op
(:func:`fp8engine.ops.linear.linear`, the fused MLP and QKV ops) through a
:class:`~fp8engine.parallel.linear_ops.TPLinearComm` built once per layer (:func:`tp_comm`): the sequence-parallel
all-gather moves FP8 bytes, and the dgrad all-reduce / reduce-scatter overlaps the wgrad GEMM. In high precision the
gathers and reductions are the region mappings of :mod:`fp8engine.parallel.mappings` around the GEMMs
(:func:`enter_column_parallel`, :func:`exit_row_parallel`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from fp8engine.fp8.quantizer import call_kernels
from fp8engine.modules.base import FP8_INPUT_DTYPES, FP8Module, check_fp8_input
from fp8engine.modules.fp8_init import fp8_init_config
from fp8engine.ops.init import init_linear_params
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear
from fp8engine.ops.norm_linear import NORMALIZATIONS, norm, norm_cast
from fp8engine.ops.qkv import fp8_linear_qkv, split_grouped_qkv

__all__ = ["LayerNormLinear"]


# ---------------------------------------------------------------------------------------------------------------
# Tensor-parallel helpers shared by LayerNormLinear, LayerNormMLP and MultiheadAttention.

def tp_size_rank(tp_group) -> tuple[int, int]:
    """``(size, rank)`` of ``tp_group``; ``(1, 0)`` for None without importing torch.distributed."""
    if tp_group is None:
        return 1, 0
    from fp8engine.parallel.utils import get_group_rank, get_group_size

    return get_group_size(tp_group), get_group_rank(tp_group)


def check_divisible(what: str, value: int, tp_size: int, owner: str) -> int:
    """``value // tp_size``, or ``ValueError`` saying what to change."""
    if value % tp_size:
        raise ValueError(f"{owner}: {what}={value} is not divisible by the tensor-parallel size {tp_size}; "
                         f"choose {what} as a multiple of {tp_size} or a smaller tp_group")
    return value // tp_size


def check_choice(what: str, value, choices: Sequence, owner: str) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: unknown {what}={value!r}; use one of {tuple(choices)}")


def tp_comm(tp_group, parallel_mode: str, sequence_parallel: bool):
    """The :class:`~fp8engine.parallel.linear_ops.TPLinearComm` of a ``"column"`` / ``"row"`` parallel GEMM over
    ``tp_group`` (None: no communication, None returned)."""
    if tp_group is None:
        return None
    from fp8engine.parallel.linear_ops import TPLinearComm

    return TPLinearComm(tp_group, parallel_mode, sequence_parallel)


def enter_column_parallel(x: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """Input of a column-parallel GEMM: all-gather the sequence shards ``[s/tp, ...] -> [s, ...]`` (sequence
    parallel; backward reduce-scatter) or an identity whose backward all-reduces the gradient."""
    if tp_group is None:
        return x
    from fp8engine.parallel import mappings

    if sequence_parallel:
        return mappings.gather_from_sequence_parallel_region(x, tp_group)
    return mappings.copy_to_tensor_model_parallel_region(x, tp_group)


def exit_row_parallel(y: torch.Tensor, bias: Optional[torch.Tensor], tp_group, sequence_parallel: bool
                      ) -> torch.Tensor:
    """Output of a row-parallel GEMM: sum the partial results over ranks (reduce-scatter to ``[s/tp, ...]`` when
    sequence parallel, else all-reduce), then add the (full, unsharded) bias."""
    if tp_group is not None:
        from fp8engine.parallel import mappings

        if sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, tp_group)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, tp_group)
    return y if bias is None else y + bias


def master_weight(out_features: int, in_features: int, bias: bool, init_method: Optional[Callable], device=None
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The full (unsharded) fp32 weight ``[out, in]`` and bias ``[out]`` on ``device`` (CPU when None), drawn from
    that device's current RNG (:func:`fp8engine.ops.init.init_linear_params`): every rank draws the same master
    (the same seed) and keeps its slice. On the device: an 8B model's 7 G values drawn on the CPU took ~80 s per
    rank (torchrun's one OpenMP thread), on a GPU well under a second."""
    return init_linear_params(out_features, in_features, bias, init_method, device=device)


def shard(t: torch.Tensor, dim: int, segments: Sequence[int], rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim``: ``t`` is cut into ``segments`` (sizes), each segment into
    ``tp_size`` equal chunks, and chunk ``rank`` of every segment is concatenated (e.g. swiglu's ``[gate | up]``
    gives each rank ``[gate_r | up_r]``)."""
    if tp_size == 1:
        return t
    return torch.cat([seg.chunk(tp_size, dim)[rank] for seg in t.split(list(segments), dim)], dim)


def new_param(t: torch.Tensor, dtype, device) -> nn.Parameter:
    return nn.Parameter(t.to(dtype=dtype, device=device).contiguous())


# ---------------------------------------------------------------------------------------------------------------
# The input norm and the outputs shared by LayerNormLinear and LayerNormMLP.
# ---------------------------------------------------------------------------------------------------------------
def input_norm(module, x: torch.Tensor, quantizer, residual: Optional[torch.Tensor], kernels: bool):
    """The input norm of a LayerNorm + GEMM module (``LayerNormLinear``, ``LayerNormMLP``): ``(ln, ln_fp8, s)``;
    ``kernels``: the module call's backend (:func:`~fp8engine.fp8.quantizer.call_kernels`).

    Under FP8 (``quantizer``: the first GEMM's input role) and without sequence parallelism the norm op also
    writes the FP8 copy (on the kernel path in the norm kernel, ``ln`` then only a gradient carrier unless
    ``return_layernorm_output``; under ``Float8BlockScaling`` the block norm kernel writes the 1 x 128-tiled copy,
    rows padded to 128, and its re-tiled transpose: :func:`fp8engine.ops.norm_linear.norm_cast`); otherwise
    ``ln_fp8`` is None (sequence parallel: the cast comes after the all-gather). ``s`` is the normalised tensor,
    ``x`` or ``x + residual`` (see :func:`fp8engine.ops.norm_linear.norm`)."""
    common = dict(rms=module._rms, zero_centered_gamma=module.zero_centered_gamma, residual=residual)
    common["return_input"] = True
    if quantizer is None or module.sequence_parallel:
        ln, s = norm(x, module.layer_norm_weight, module.layer_norm_bias, module.eps, kernels=kernels, **common)
        return ln, None, s
    return norm_cast(x, module.layer_norm_weight, module.layer_norm_bias, module.eps, quantizer=quantizer,
                     transpose=torch.is_grad_enabled(),
                     return_hp=module.return_layernorm_output, **common)


def norm_module_outputs(module, y: torch.Tensor, ln: torch.Tensor, s: torch.Tensor, return_norm_input: bool):
    """``y``, then ``ln`` with ``module.return_layernorm_output``, then ``s`` with ``return_norm_input``: a tuple
    when more than ``y`` is returned."""
    result = (y, ln) if module.return_layernorm_output else (y,)
    if return_norm_input:
        result += (s,)
    return result if len(result) > 1 else y


class LayerNormLinear(FP8Module):
    """``y = norm(x) @ weight.T + bias``; inside :func:`fp8engine.autocast` the norm op writes its output in FP8
    directly for the GEMM (state rows ``("input", "weight", "grad_output")``, input = the norm output).

    Under ``Float8BlockScaling`` the same ops run block-scaled: on the kernel path the norm kernel writes the
    1 x 128-tiled FP8 input (and its re-tiled transpose), and with ``qkv_split`` the QKV op's backward casts the
    gradient block-scaled straight from dq, dk, dv (the rotation's gradient and the bias gradient in the same
    pass). In and out features must then be multiples of 128 (``ValueError`` at the first FP8 forward).

    Outside autocast it equals ``F.linear(F.layer_norm(x, ...), weight, bias)`` (or ``F.rms_norm``) bit for bit.

    Args:
        in_features, out_features: ``K`` (normalised dim) and ``N``; multiples of 16 for FP8.
        bias: learnable ``[N]`` bias. normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (``None``: no norm, used by
            MultiheadAttention(input_layernorm=False)). eps: added to the variance.
        return_layernorm_output: forward returns ``(y, norm(x))``.
        zero_centered_gamma: the norm weight stores ``gamma - 1`` (see :class:`fp8engine.modules.LayerNorm`).
        params_dtype, device: of parameters and state. init_method: ``fn(weight)``, applied to the full
            ``[N, K]`` master weight on CPU (bias then zero); default ``torch.nn.Linear``'s initialisation.
        fuse_wgrad_accumulation: GEMM weight gradients go to an fp32 ``main_grad`` the user allocates on every
            GEMM weight (``weight.grad`` stays None); norm parameters and biases keep ``.grad``. Always on under
            :func:`fp8engine.fp8_model_init` (FP8 ``weight`` with ``weight_scale_inv``).
        tp_group, parallel_mode: ``"column"`` with a group splits ``N`` over its ranks (local weight
            ``[N/tp, K]``); the input is all-gathered along the sequence (``sequence_parallel``, input
            ``[s/tp, b, K]``; in FP8 under FP8) or copied (input ``[s, b, K]``), the output is ``[s, b, N/tp]``;
            the input gradient is all-reduced (reduce-scattered) while the wgrad GEMM runs.
        parameters_split: ``{prefix: rows}`` to keep the weight as several parameters ``{prefix}weight`` /
            ``{prefix}bias`` (e.g. query/key/value), concatenated in forward; each part is sharded on its own.
        row_order: internal (MultiheadAttention): a permutation applied to the master weight's rows before it
            is split and sharded, so differently laid-out layers draw the same values from the same seed.
    Raises:
        ValueError: unknown normalization/parallel_mode, tp size not dividing a split, fused wgrad or
            ``fp8_model_init`` with a split weight.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 normalization: Optional[str] = "LayerNorm",
                 eps: float = 1e-5, return_layernorm_output: bool = False, zero_centered_gamma: bool = False,
                 params_dtype=None, device=None, init_method: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, parameters_split: Optional[dict] = None,
                 row_order: Optional[torch.Tensor] = None):
        name = type(self).__name__
        if normalization is not None:
            check_choice("normalization", normalization, NORMALIZATIONS, name)
        check_choice("parallel_mode", parallel_mode, (None, "column"), name)
        if tp_group is not None and parallel_mode != "column":
            raise ValueError(f"{name}: tp_group needs parallel_mode='column' (the only split LayerNormLinear has)")
        split = dict(parameters_split or {"": out_features})
        if sum(split.values()) != out_features:
            raise ValueError(f"{name}: parameters_split sizes {split} do not add up to out_features={out_features}")
        if fuse_wgrad_accumulation and len(split) > 1:
            raise ValueError(f"{name}: fuse_wgrad_accumulation needs one weight parameter; drop parameters_split "
                             "(fuse_qkv_params=True in MultiheadAttention)")
        tp_size, rank = tp_size_rank(tp_group if parallel_mode == "column" else None)
        local = {prefix: check_divisible(f"{prefix}out_features", n, tp_size, name) for prefix, n in split.items()}
        local_out = sum(local.values())
        super().__init__(LINEAR_ROLES, [(in_features, local_out)], device=device)
        self.in_features, self.out_features = in_features, local_out
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.tp_group = tp_group if tp_size > 1 else None
        self.sequence_parallel = sequence_parallel and self.tp_group is not None
        self._comm = tp_comm(self.tp_group, "column", self.sequence_parallel)
        dtype = params_dtype or torch.get_default_dtype()
        self._rms = normalization == "RMSNorm"
        self.layer_norm_weight = self.layer_norm_bias = None
        if normalization is not None:
            init = torch.zeros if zero_centered_gamma else torch.ones
            self.layer_norm_weight = nn.Parameter(init(in_features, dtype=dtype, device=device))
            if not self._rms:
                self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, dtype=dtype, device=device))
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:  # partial gradients per sequence shard: all-reduce them over tp_group
                    p.sequence_parallel = self.sequence_parallel
        w, b = master_weight(out_features, in_features, bias, init_method, device)
        if row_order is not None:
            w, b = w[row_order], (None if b is None else b[row_order])
        w, b = w.split(list(split.values())), (b.split(list(split.values())) if bias else [None] * len(split))
        self._weight_names, self._bias_names = [], []
        for (prefix, _), wp, bp in zip(split.items(), w, b):
            self.register_parameter(f"{prefix}weight", new_param(shard(wp, 0, [wp.shape[0]], rank, tp_size),
                                                                  dtype, device))
            self._weight_names.append(f"{prefix}weight")
            if bias:
                self.register_parameter(f"{prefix}bias", new_param(shard(bp, 0, [bp.shape[0]], rank, tp_size),
                                                                    dtype, device))
                self._bias_names.append(f"{prefix}bias")
        if not bias:
            self.bias = None
        if len(self._weight_names) > 1 and fp8_init_config() is not None:
            raise ValueError(f"{name}: fp8_model_init needs one weight parameter (FP8 weights with separate scales "
                             "cannot be concatenated); drop parameters_split (fuse_qkv_params=True in "
                             "MultiheadAttention)")
        self._init_fp8_weights(self._weight_names)

    def _weight_bias(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if len(self._weight_names) == 1:
            return getattr(self, self._weight_names[0]), (getattr(self, self._bias_names[0]) if self._bias_names
                                                          else None)
        w = torch.cat([getattr(self, n) for n in self._weight_names])
        b = torch.cat([getattr(self, n) for n in self._bias_names]) if self._bias_names else None
        return w, b

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                qkv_split: Optional[tuple[int, int, int]] = None, *, residual: Optional[torch.Tensor] = None,
                return_norm_input: bool = False, qkv_rope: Optional[torch.Tensor] = None):
        """``x``: ``[s, b, K]`` (``[s/tp, b, K]`` when sequence parallel) -> ``[s, b, N_local]``, or
        ``(y, norm(x))`` with ``return_layernorm_output``. ``is_first_microbatch``: FP8 weight caching
        (see :class:`fp8engine.modules.base.FP8WeightCache`). ``qkv_split = (g, hpg, d)`` (MultiheadAttention's
        fused QKV weight): return ``(q, k, v)``, the grouped views of :func:`fp8engine.ops.qkv.fp8_linear_qkv`,
        instead of ``y``; with ``qkv_rope`` (rotary angles ``[s, 1, 1, r]``, only with ``qkv_split``) q and k come
        back rotated (one kernel pass from the projection output where the kernels run; the rotation's gradient is
        applied in the QKV-gradient cast).

        Residual connection (TransformerLayer uses both): ``residual`` (like ``x``) normalises ``x + residual``,
        the add done by the norm kernel; ``return_norm_input`` appends the normalised tensor (``x`` or
        ``x + residual``) to the outputs, and a gradient flowing into it is added inside the norm's backward."""
        if qkv_rope is not None and qkv_split is None:
            raise ValueError("LayerNormLinear: qkv_rope (rotary angles) is only taken with qkv_split")
        quantizers = self.fp8_begin()
        if quantizers is not None and x.dtype not in FP8_INPUT_DTYPES:
            check_fp8_input(x, type(self).__name__)
        q = None if quantizers is None else quantizers[0]
        kernels = call_kernels(x, quantizers)  # this call's backend: its norm's and its QKV split's
        weight, bias = self._weight_bias()
        if self.normalization is None:
            ln = s = x if residual is None else x + residual
            ln_fp8 = None
        else:
            ln, ln_fp8, s = input_norm(self, x, None if q is None else q.input, residual, kernels)
        fuse = self.fuse_wgrad_accumulation
        if q is not None:  # the op communicates (module docstring)
            w_fp8 = self.fp8_weight("weight", weight, q.weight, is_first_microbatch)
            if qkv_split is not None:
                out = fp8_linear_qkv(ln, weight, bias, q, qkv_split, w_fp8=w_fp8, x_fp8=ln_fp8, fuse_wgrad=fuse,
                                     comm=self._comm, freqs=qkv_rope)
            else:
                out = fp8_linear(ln, weight, bias, q, w_fp8=w_fp8, x_fp8=ln_fp8, fuse_wgrad=fuse, comm=self._comm)
            return norm_module_outputs(self, out, ln, s, return_norm_input)
        total = enter_column_parallel(ln, self.tp_group, self.sequence_parallel)
        out = self.hp_linear(total, self._weight_names[0], weight, bias)
        if qkv_split is not None:
            out = split_grouped_qkv(out, *qkv_split, freqs=qkv_rope, kernels=kernels)
        return norm_module_outputs(self, out, ln, s, return_norm_input)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local), "
                f"normalization={self.normalization}, tp={self.tp_group is not None}")
