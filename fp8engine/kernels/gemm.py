"""FP8 GEMM that accumulates into an fp32 output in its epilogue: ``out += (a @ b.T) * a_scale_inv * b_scale_inv``.

What it is for: ``fuse_wgrad_accumulation`` (TransformerEngine's performance guide; Megatron-LM's
``gradient_accumulation_fusion``). The weight gradient ``dW = dY^T @ X`` goes straight into the fp32
``weight.main_grad`` the user allocated: the kernel reads ``main_grad`` once and writes it once, instead of a
``torch._scaled_mm`` into a new fp32 ``[N, K]`` buffer followed by ``main_grad.add_`` (which reads that buffer
and ``main_grad`` and writes ``main_grad`` again). ``torch._scaled_mm`` has no accumulate (beta) argument.

Operands (the "TN" form of ``fp8engine.ops.gemm``): ``a [M, K]`` and ``b [N, K]``, FP8 (E4M3 or E5M2, mixed allowed),
row-major (K contiguous; for wgrad ``a = dY^T``, ``b = X^T``, the transposed copies the cast kernels write);
``out [M, N]`` fp32 row-major. Any K: the K loop masks the tail, so no padding of the token dim is needed.

Numerics: products of FP8 values are exact in fp32; they are summed in fp32 on the tensor cores with the
accumulator promoted to a full fp32 register sum every ``BLOCK_K`` (``max_num_imprecise_acc=BLOCK_K``), the
counterpart of cuBLASLt's split accumulation (``use_fast_accum=False``) that the non-fused wgrad uses; then one
multiply by ``a_scale_inv * b_scale_inv`` and one fp32 add into ``out``. The summation order differs from cuBLAS, so
results agree to fp32 rounding (tests: against float64 within ``K * 2^-23 * sum|a*b|``), not bit for bit.

Structure after the Triton tutorial 03-matrix-multiplication (grouped program order for L2 reuse, a K loop of
``tl.dot``), rewritten with the accumulate epilogue, K-tail masking and the scale factors.
"""

from __future__ import annotations

import torch

from ._common import check_launchable, tl, triton

__all__ = ["fp8_gemm_accumulate", "fp8_gemm_accumulate_reference"]

#: Tile and launch configuration (one fixed config: no autotuning, so results do not depend on a timing run).
#: 128 x 128 x 128 with 8 warps and 4 stages, the Hopper FP8 configuration of the Triton matmul tutorial's list;
#: tools/tune_kernels.py times it against cuBLAS + add on the H200 (docs/benchmarks.md).
BLOCK_M = 128
BLOCK_N = 128
BLOCK_K = 128
GROUP_M = 8
NUM_WARPS = 8
NUM_STAGES = 4
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _fp8_gemm_acc_kernel(
    a_ptr,  # [M, K] FP8, row-major
    b_ptr,  # [N, K] FP8, row-major
    out_ptr,  # [M, N] fp32, row-major: out += a @ b.T * a_scale_inv * b_scale_inv
    a_si_ptr,  # [1] fp32 a_scale_inv
    b_si_ptr,  # [1] fp32 b_scale_inv
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks walk the column blocks together, so their b tiles stay in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N load row 0 again (modulo) instead of being masked, as the tutorial; they are not stored
    a_rows = (offs_m % M).to(tl.int64)
    b_rows = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + b_rows[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k[None, :] < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * (tl.load(a_si_ptr) * tl.load(b_si_ptr))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, tl.load(out_ptrs, mask=mask, other=0.0) + acc, mask=mask)


def _check(a, a_scale_inv, b, b_scale_inv, out, op):
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FP8:
            raise TypeError(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)} "
                             f"(contiguous={t.is_contiguous()})")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: a [M, K] and b [N, K] disagree on K: {tuple(a.shape)} vs {tuple(b.shape)}")
    if out.dtype != torch.float32:
        raise TypeError(f"{op}: out (the accumulator, e.g. weight.main_grad) must be float32, got {out.dtype}")
    if tuple(out.shape) != (a.shape[0], b.shape[0]) or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous [{a.shape[0]}, {b.shape[0]}] tensor, got shape "
                         f"{tuple(out.shape)} (contiguous={out.is_contiguous()})")
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"{op}: {name} must be a 1-element float32 tensor, got {t.dtype} {tuple(t.shape)}")
    for t in (b, out, a_scale_inv, b_scale_inv):
        if t.device != a.device:
            raise ValueError(f"{op}: all tensors must be on one device; a is on {a.device}, got {t.device}")


def fp8_gemm_accumulate(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """``out += (a.float() @ b.float().T) * a_scale_inv * b_scale_inv`` in one FP8 GEMM; returns ``out``.

    Args:
        a: ``[M, K]`` FP8, contiguous. b: ``[N, K]`` FP8, contiguous (E4M3 / E5M2 in any combination).
        a_scale_inv, b_scale_inv: 1-element float32 dequantization factors.
        out: ``[M, N]`` float32, contiguous; updated in place (e.g. ``weight.main_grad``).
    Raises:
        TypeError: non-FP8 operands, a non-fp32 ``out``, or scale_inv not a 1-element fp32 tensor.
        ValueError: shapes disagree, a tensor is not contiguous, tensors on different devices, or a CPU tensor
            without TRITON_INTERPRET=1.
    """
    op = "fp8_gemm_accumulate"
    check_launchable(a, op)
    _check(a, a_scale_inv, b, b_scale_inv, out, op)
    m, n = out.shape
    if m == 0 or n == 0 or a.shape[1] == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
    _fp8_gemm_acc_kernel[grid](
        a, b, out, a_scale_inv, b_scale_inv, m, n, a.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


def fp8_gemm_accumulate_reference(a, a_scale_inv, b, b_scale_inv, out):
    """Plain-PyTorch :func:`fp8_gemm_accumulate` (fp32 matmul of the decoded FP8 values; same checks)."""
    _check(a, a_scale_inv, b, b_scale_inv, out, "fp8_gemm_accumulate_reference")
    out += (a.float() @ b.float().t()) * (a_scale_inv.float() * b_scale_inv.float())
    return out
