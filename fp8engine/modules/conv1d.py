"""``Conv1DLinear``: the FP8 :class:`~fp8engine.modules.linear.Linear` for ``transformers``' ``Conv1D`` (GPT-2),
whose weight is stored transposed, ``[in_features, out_features]``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from fp8engine.modules.fp8_init import fp8_init_config
from fp8engine.modules.linear import Linear, autocast_input
from fp8engine.ops.linear import fp8_linear

__all__ = ["Conv1DLinear"]


class Conv1DLinear(Linear):
    """``y = x @ weight + bias`` with ``weight [K, N]`` (``transformers.pytorch_utils.Conv1D``'s layout), in FP8
    inside :func:`fp8engine.autocast`.

    The parameters keep ``Conv1D``'s names and shapes (``weight [K, N]``, ``bias [N]``), so a state dict of the
    converted model has the keys and shapes of the original (plus ``fp8_state`` buffers). The GEMM runs on
    ``weight.t()`` made contiguous (one ``[N, K]`` copy per forward, in the weight's dtype); gradients flow back to
    ``weight`` through that copy. ``fuse_wgrad_accumulation`` is not offered (``main_grad`` belongs to the view).

    Args:
        in_features, out_features: ``K`` and ``N`` (``Conv1D``'s ``nx`` and ``nf``); multiples of 16 for FP8 (128 under
            ``Float8BlockScaling``).
        bias: add a learnable ``[N]`` bias.
        params_dtype, device: as for :class:`Linear`.
    Shapes: input ``[*, K]`` -> output ``[*, N]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, params_dtype=None, device=None):
        super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype, device=device)
        self.weight = torch.nn.Parameter(self.weight.detach().t().contiguous())  # [K, N]

    def _init_fp8_weights(self, names) -> None:
        """Refuse :func:`fp8engine.fp8_model_init` (``TypeError``): the transposed ``[K, N]`` weight has no FP8
        primary form here; build the layer outside the region (or inside ``fp8_model_init(enabled=False)``)."""
        if fp8_init_config() is not None:
            raise TypeError("Conv1DLinear keeps transformers' transposed [K, N] weight and cannot hold an FP8 primary "
                            "weight; build it outside fp8_model_init (or under fp8_model_init(enabled=False))")
        super()._init_fp8_weights(names)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], quantizers, is_first_microbatch: Optional[bool],
                comm=None):
        w = self.weight.t()  # [N, K] view
        if quantizers is None:
            return F.linear(x, w, bias)
        x = autocast_input(x)
        w = w.contiguous()
        q = quantizers[0]
        w_fp8 = self.fp8_weight("weight", w, q.weight, is_first_microbatch)
        return fp8_linear(x, w, bias, q, w_fp8=w_fp8, fuse_wgrad=False, comm=comm)
