"""``fp8engine.Linear``: ``torch.nn.Linear`` whose GEMMs run in FP8 inside ``autocast``."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fp8engine.modules.base import FP8_INPUT_DTYPES, FP8Module, check_fp8_input
from fp8engine.modules.layernorm_linear import (check_choice, check_divisible, enter_column_parallel,
                                                exit_row_parallel, master_weight, new_param, shard, tp_comm,
                                                tp_size_rank)
from fp8engine.ops.init import default_init
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear

__all__ = ["Linear", "default_init", "autocast_input", "check_fp8_input", "FP8_INPUT_DTYPES"]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast to ``torch.autocast``'s dtype when autocast is on for its device and ``x`` is another floating
    dtype (e.g. an fp32 norm output in a ``transformers`` model under ``torch.autocast(dtype=torch.bfloat16)``),
    as ``torch.nn.functional.linear`` would; else ``x`` itself."""
    device_type = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device_type):
        return x
    dtype = torch.get_autocast_dtype(device_type)
    return x if x.dtype == dtype else x.to(dtype)


class Linear(FP8Module):
    """``y = x @ weight.T + bias``, in FP8 inside :func:`fp8engine.autocast`.

    Outside autocast it is ``torch.nn.functional.linear``, bit for bit. Inside, fprop/dgrad/wgrad run as FP8
    GEMMs, the scaling state (``fp8_state``: amax history and scale of input, weight, grad_output) lives in
    buffers, so ``state_dict`` round-trips it. Under ``Float8BlockScaling`` the same op runs the three GEMMs
    block-scaled (:func:`fp8engine.ops.linear.linear`: input and gradient 1 x 128 tiles, weight 128 x 128 blocks,
    scales just in time; the ``fp8_state`` buffers are not used).

    Args:
        in_features, out_features: ``K`` and ``N`` (of the whole layer; per rank they are divided as below); FP8
            needs both (per rank) to be multiples of 16, of 128 under ``Float8BlockScaling`` (``ValueError`` at the
            first FP8 forward otherwise).
        bias: add a learnable ``[N]`` bias.
        params_dtype: dtype of weight and bias (default ``torch.get_default_dtype()``).
        device: where to allocate parameters and state.
        init_method: ``fn(weight)`` initialising the ``[N, K]`` weight in place (bias then zeroed, as in
            Megatron); default ``torch.nn.Linear``'s initialisation.
        fuse_wgrad_accumulation: weight gradients are added to an fp32 ``weight.main_grad`` that the user
            allocates; ``weight.grad`` stays None. Under FP8 on CUDA the wgrad GEMM accumulates into
            ``main_grad`` itself (cuBLASLt, beta = 1; ``fp8engine.ops.gemm.fp8_mm_accumulate``). Always on for a
            layer built under :func:`fp8engine.fp8_model_init` (its ``weight`` is then FP8, with ``weight_scale_inv``).
        return_bias: forward returns ``(y, bias)`` with the bias NOT added (TransformerEngine's argument, for a later
            fused bias-dropout-add); ``bias`` is None without one.
        parallel_mode, tp_group, sequence_parallel: tensor parallelism over ``tp_group`` (TransformerEngine's
            semantics, as :class:`fp8engine.parallel.ColumnParallelLinear` / ``RowParallelLinear``; no split when
            the group has one rank or ``parallel_mode`` is None). ``"column"``: this rank holds ``weight [N/tp, K]``
            and ``bias [N/tp]``; input ``[s, b, K]`` (``[s/tp, b, K]`` all-gathered along the sequence when
            ``sequence_parallel``; the input gradient is all-reduced / reduce-scattered), output ``[s, b, N/tp]``.
            ``"row"``: ``weight [N, K/tp]`` and the full ``bias [N]``; input ``[s, b, K/tp]`` (already split), the
            partial outputs summed over the ranks (all-reduce, or reduce-scatter to ``[s/tp, b, N]`` when
            ``sequence_parallel``: the bias then has ``sequence_parallel = True``), then the bias added. The
            weights are the slices of the layer built unsharded from the same seed. Under FP8 (any recipe) the
            communication runs inside the linear op (:class:`~fp8engine.ops.comm.LinearComm`; FP8 all-gather);
            in high precision through :mod:`fp8engine.parallel.mappings`.
    Shapes: input ``[*, K]`` -> output ``[*, N]`` in the input's dtype (per rank as above).
    Raises:
        ValueError: unknown ``parallel_mode``, a tp size not dividing the split dim. TypeError (forward, FP8): an
            input that is not float32/bfloat16/float16 (:func:`check_fp8_input`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, params_dtype=None, device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, fuse_wgrad_accumulation: bool = False,
                 *, return_bias: bool = False, parallel_mode: Optional[str] = None, tp_group=None,
                 sequence_parallel: bool = False):
        name = type(self).__name__
        check_choice("parallel_mode", parallel_mode, (None, "column", "row"), name)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"{name} needs positive in_features/out_features, got {in_features}, {out_features}")
        tp_size, rank = tp_size_rank(tp_group if parallel_mode is not None else None)
        in_local = check_divisible("in_features", in_features, tp_size, name) if parallel_mode == "row" else in_features
        out_local = (check_divisible("out_features", out_features, tp_size, name) if parallel_mode == "column"
                     else out_features)
        super().__init__(LINEAR_ROLES, [(in_local, out_local)], device=device)
        self.in_features, self.out_features = in_local, out_local
        self.fuse_wgrad_accumulation, self.return_bias = fuse_wgrad_accumulation, return_bias
        self.parallel_mode = parallel_mode if tp_size > 1 else None
        self.tp_group = tp_group if tp_size > 1 else None
        self.sequence_parallel = sequence_parallel and self.tp_group is not None
        self._comm = tp_comm(self.tp_group, self.parallel_mode, self.sequence_parallel)
        dtype = params_dtype or torch.get_default_dtype()
        if self.tp_group is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
            with torch.no_grad():
                if init_method is None:
                    default_init(self.weight, self.bias)
                else:
                    init_method(self.weight)
                    if self.bias is not None:
                        self.bias.zero_()
        else:  # tensor parallel: every rank draws the full master weight (same seed) and keeps its slice
            w, b = master_weight(out_features, in_features, bias, init_method, device)
            column = self.parallel_mode == "column"
            self.weight = new_param(shard(w, 0 if column else 1, [w.shape[0 if column else 1]], rank, tp_size), dtype,
                                    device)
            self.bias = None
            if bias:
                self.bias = new_param(shard(b, 0, [out_features], rank, tp_size) if column else b, dtype, device)
                self.bias.sequence_parallel = self.sequence_parallel and not column  # partial grads per shard
        self._init_fp8_weights(("weight",))

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """``x``: ``[*, in_features]`` -> ``[*, out_features]`` (``(y, bias)`` with ``return_bias``; shapes per rank
        in the class docstring); ``is_first_microbatch``: FP8 weight caching (see :class:`FP8WeightCache`)."""
        quantizers = self.fp8_begin()
        if quantizers is not None and x.dtype not in FP8_INPUT_DTYPES:
            check_fp8_input(x, type(self).__name__)
        bias = None if self.return_bias else self.bias
        if self.tp_group is None or quantizers is not None:
            y = self._linear(x, bias, quantizers, is_first_microbatch, comm=self._comm)  # the op communicates
        elif self.parallel_mode == "column":
            y = self._linear(enter_column_parallel(x, self.tp_group, self.sequence_parallel), bias, quantizers,
                             is_first_microbatch)
        else:
            y = exit_row_parallel(self._linear(x, None, quantizers, is_first_microbatch), bias, self.tp_group,
                                  self.sequence_parallel)
        return (y, self.bias) if self.return_bias else y

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], quantizers, is_first_microbatch: Optional[bool],
                comm=None):
        """The GEMM with a given bias under ``quantizers`` (:meth:`fp8_begin`'s result). ``comm``: the FP8 op's
        tensor-parallel communication (a :class:`~fp8engine.ops.comm.LinearComm`; ignored by the high-precision
        path, whose caller communicates around it)."""
        if quantizers is None:
            return self.hp_linear(x, "weight", self.weight, bias)
        x = autocast_input(x)
        q = quantizers[0]
        w_fp8 = self.fp8_weight("weight", self.weight, q.weight, is_first_microbatch)
        return fp8_linear(x, self.weight, bias, q, w_fp8=w_fp8, fuse_wgrad=self.fuse_wgrad_accumulation, comm=comm)

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.parallel_mode}" if self.tp_group is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{tp}"
