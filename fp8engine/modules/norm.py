"""``LayerNorm`` and ``RMSNorm`` over the last dim (TransformerEngine's modules, incl. ``zero_centered_gamma``)."""
from __future__ import annotations

import torch
from torch import nn

from fp8engine.fp8.quantizer import call_kernels
from fp8engine.ops.norm_linear import norm

__all__ = ["LayerNorm", "RMSNorm"]


class _Norm(nn.Module):
    _rms = False

    def __init__(self, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool = False, params_dtype=None,
                 device=None):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_size must be positive, got {hidden_size}")
        self.hidden_size, self.eps, self.zero_centered_gamma = hidden_size, eps, zero_centered_gamma
        dtype = params_dtype or torch.get_default_dtype()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.bias = None if self._rms else nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., hidden_size]`` -> same shape and dtype."""
        return norm(x, self.weight, self.bias, self.eps, rms=self._rms, kernels=call_kernels(x),
                    zero_centered_gamma=self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last dim; equals ``torch.nn.LayerNorm``
    (``F.layer_norm``) bit for bit on CPU.

    Args:
        hidden_size: size ``N`` of the last dim. eps: added to the variance.
        zero_centered_gamma: store ``gamma - 1`` in ``weight`` (initialised to 0; the effective gamma is
            ``1 + weight``), which keeps weight decay from pulling gamma towards 0.
        params_dtype: dtype of ``weight``/``bias`` (default ``torch.get_default_dtype()``). device: where.
    """


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last dim (no bias); equals ``torch.nn.RMSNorm``.
    Arguments as :class:`LayerNorm`."""

    _rms = True
