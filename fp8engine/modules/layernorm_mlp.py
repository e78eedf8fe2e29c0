"""``LayerNormMLP``: norm -> fc1 -> activation -> fc2, both GEMMs in FP8 inside autocast, optionally tensor
parallel (fc1 column-parallel, fc2 row-parallel; Megatron-LM's MLP). Under FP8 (any recipe) the tensor-parallel
communication runs inside the MLP op (:func:`fp8engine.ops.mlp.fp8_mlp`, one
:class:`~fp8engine.parallel.linear_ops.TPLinearComm` per GEMM); in high precision through the region mappings."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from fp8engine.fp8.quantizer import call_kernels
from fp8engine.modules.base import FP8_INPUT_DTYPES, FP8Module, check_fp8_input
from fp8engine.modules.layernorm_linear import (check_choice, check_divisible, enter_column_parallel,
                                                exit_row_parallel, input_norm, master_weight, new_param,
                                                norm_module_outputs, shard, tp_comm, tp_size_rank)
from fp8engine.ops.mlp import ACTIVATIONS, MLP_ROLES, _unfused_fp8_mlp, activation, fp8_mlp
from fp8engine.ops.norm_linear import NORMALIZATIONS

__all__ = ["LayerNormMLP"]



class LayerNormMLP(FP8Module):
    """``y = fc2(act(fc1(norm(x))))`` with TransformerEngine's parameter names (``layer_norm_weight``,
    ``layer_norm_bias``, ``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias``).

    Inside :func:`fp8engine.autocast` the norm writes fc1's FP8 input and the activation writes fc2's FP8 input;
    one :class:`ScalingState` holds rows ``MLP_ROLES`` (fc1 input/weight/grad_output, then fc2's). Outside autocast
    it is plain PyTorch (``F.layer_norm``/``F.rms_norm``, ``F.linear``, the activation), bit for bit.

    Under ``Float8BlockScaling`` the same op runs both GEMMs block-scaled. On the kernel path the norm kernel
    writes fc1's 1 x 128-tiled FP8 input, the activation kernel fc2's and the activation-backward kernel fc1's FP8
    gradient (with dbias), each with its re-tiled transpose; on the CPU reference path the torch norm and
    activation, each output cast by the quantizer. ``gelu_epilogue`` does not apply. ``hidden_size`` and ``F/tp``
    (``2F/tp`` for swiglu) must be multiples of 128.

    Args:
        hidden_size: ``h``; ffn_hidden_size: ``F`` (both multiples of 16 for FP8, ``F/tp`` too).
        activation: ``"gelu"`` (tanh approximation), ``"relu"`` or ``"swiglu"`` (fc1 then has ``2F`` outputs,
            ``[gate | up]``, and the activation is ``silu(gate) * up``).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``. bias: fc1/fc2 biases. eps: norm epsilon.
        return_layernorm_output: forward returns ``(y, norm(x))``. zero_centered_gamma: norm weight = gamma - 1.
        params_dtype, device: of parameters and state.
        init_method, output_layer_init_method: ``fn(weight)`` for the full fc1 / fc2 master weights (built on CPU
            from the current RNG, then sliced per rank); default ``torch.nn.Linear``'s initialisation.
        fuse_wgrad_accumulation: fc1/fc2 weight gradients go to fp32 ``main_grad`` (``.grad`` stays None). Always
            on under :func:`fp8engine.fp8_model_init` (FP8 ``fc1_weight`` / ``fc2_weight`` with their
            ``*_scale_inv``).
        tp_group, set_parallel_mode: with both, fc1 is column-parallel (local ``[F/tp (x2 for swiglu), h]``, each
            rank keeps matching gate/up halves) and fc2 row-parallel (local ``[h, F/tp]``, bias added after the
            reduction). sequence_parallel: input and output are sequence shards ``[s/tp, b, h]``.
        fused: FP8 path: fc1 -> activation -> fc2 as one autograd node (:func:`fp8engine.ops.mlp.fp8_mlp`).
            False runs the equivalent three-node composition (tests compare the two).
        gelu_epilogue: GELU on a GPU: fc1's GEMM applies it in cuBLASLt's epilogue and writes fc2's FP8 input
            itself (:func:`fp8engine.ops.mlp.fc1_fprop_act`). False: the GEMM, then the Triton activation kernel
            (benchmarks compare the two). None (default): the epilogue where fc1's output (tokens x F) has at
            least ``fp8engine.ops.mlp.GELU_EPILOGUE_MIN_ELEMENTS`` elements (2^27), where it gains; below, its
            extra host work costs more than the pass it saves.
    Raises:
        ValueError: unknown activation/normalization, or the tp size does not divide ``F``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 normalization: str = "LayerNorm", bias: bool = True, eps: float = 1e-5,
                 return_layernorm_output: bool = False, zero_centered_gamma: bool = False, params_dtype=None,
                 device=None, init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None, fuse_wgrad_accumulation: bool = False,
                 tp_group=None, sequence_parallel: bool = False, set_parallel_mode: bool = False,
                 fused: bool = True, gelu_epilogue: Optional[bool] = None):
        name = type(self).__name__
        check_choice("activation", activation, tuple(ACTIVATIONS), name)
        check_choice("normalization", normalization, NORMALIZATIONS, name)
        tp_size, rank = tp_size_rank(tp_group if set_parallel_mode else None)
        ffn_local = check_divisible("ffn_hidden_size", ffn_hidden_size, tp_size, name)
        width = ACTIVATIONS[activation]
        super().__init__(MLP_ROLES, [(hidden_size, width * ffn_local), (ffn_local, hidden_size)], device=device)
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_local, activation
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.fused, self.gelu_epilogue = fused, gelu_epilogue
        self.tp_group = tp_group if tp_size > 1 else None
        self.sequence_parallel = sequence_parallel and self.tp_group is not None
        self._comms = (tp_comm(self.tp_group, "column", self.sequence_parallel),
                       tp_comm(self.tp_group, "row", self.sequence_parallel))
        self._rms = normalization == "RMSNorm"
        dtype = params_dtype or torch.get_default_dtype()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.layer_norm_bias = None if self._rms else torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=dtype, device=device))
        w1, b1 = master_weight(width * ffn_hidden_size, hidden_size, bias, init_method, device)
        w2, b2 = master_weight(hidden_size, ffn_hidden_size, bias, output_layer_init_method or init_method,
                               device)
        segments = [ffn_hidden_size] * width  # swiglu: shard gate and up separately
        self.fc1_weight = new_param(shard(w1, 0, segments, rank, tp_size), dtype, device)
        self.fc1_bias = new_param(shard(b1, 0, segments, rank, tp_size), dtype, device) if bias else None
        self.fc2_weight = new_param(shard(w2, 1, [ffn_hidden_size], rank, tp_size), dtype, device)
        self.fc2_bias = new_param(b2, dtype, device) if bias else None
        # Partial gradients per sequence shard (all-reduce them over tp_group, as Megatron does).
        for p in (self.layer_norm_weight, self.layer_norm_bias, self.fc2_bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel
        self._init_fp8_weights(("fc1_weight", "fc2_weight"))

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                residual: Optional[torch.Tensor] = None, return_norm_input: bool = False):
        """``x``: ``[s, b, h]`` (``[s/tp, b, h]`` when sequence parallel) -> same shape, or ``(y, norm(x))`` with
        ``return_layernorm_output``. ``is_first_microbatch``: FP8 weight caching of fc1/fc2.

        Residual connection (as :meth:`LayerNormLinear.forward`): ``residual`` normalises ``x + residual`` (added
        by the norm kernel); ``return_norm_input`` appends the normalised tensor to the outputs, and its gradient
        is added inside the norm's backward."""
        quantizers = self.fp8_begin()
        if quantizers is not None and x.dtype not in FP8_INPUT_DTYPES:
            check_fp8_input(x, type(self).__name__)
        if quantizers is not None:  # the op communicates
            y, ln, s = self._fp8_forward(x, quantizers, is_first_microbatch, residual)
            return norm_module_outputs(self, y, ln, s, return_norm_input)
        # Row-parallel fc2 adds its bias after the reduction; unsharded, the GEMM adds it.
        fc2_bias = self.fc2_bias if self.tp_group is None else None
        ln, _, s = input_norm(self, x, None, residual, call_kernels(x))
        h = self.hp_linear(enter_column_parallel(ln, self.tp_group, self.sequence_parallel), "fc1_weight",
                           self.fc1_weight, self.fc1_bias)
        y = self.hp_linear(activation(h, self.activation), "fc2_weight", self.fc2_weight, fc2_bias)
        if self.tp_group is not None:
            y = exit_row_parallel(y, self.fc2_bias, self.tp_group, self.sequence_parallel)
        return norm_module_outputs(self, y, ln, s, return_norm_input)

    def _fp8_forward(self, x, quantizers, is_first_microbatch, residual):
        """FP8: the MLP op with fc1's and fc2's communication (fc2's bias added after its reduction)."""
        fc1, fc2 = quantizers
        ln, ln_fp8, s = input_norm(self, x, fc1.input, residual, fc1.input.kernels)
        w1 = self.fp8_weight("fc1_weight", self.fc1_weight, fc1.weight, is_first_microbatch)
        w2 = self.fp8_weight("fc2_weight", self.fc2_weight, fc2.weight, is_first_microbatch)
        mlp = fp8_mlp if self.fused else _unfused_fp8_mlp
        y = mlp(ln, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias, self.activation, fc1, fc2,
                w1_fp8=w1, w2_fp8=w2, x_fp8=ln_fp8, fuse_wgrad=self.fuse_wgrad_accumulation,
                gelu_epilogue=self.gelu_epilogue, fc1_comm=self._comms[0], fc2_comm=self._comms[1])
        return y, ln, s

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size} (local), "
                f"activation={self.activation}, normalization={self.normalization}, tp={self.tp_group is not None}")
