"""``fp8engine.kernels._launch``: the specialization key, the direct-call entry, and (CUDA) that direct launches
give the bytes of Triton's own launch path for every specialization the key separates."""
import pytest
import torch

from fp8engine.kernels import _launch
from fp8engine.kernels._launch import _make_entry, cached_entries, launch_key

triton = pytest.importorskip("triton")
jit = pytest.importorskip("triton.runtime.jit")


def _key(*args, **meta):
    return launch_key(args, meta, 0)


def test_key_separates_what_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.uint8)
    aligned, shifted = buf[:32], buf[1:33]  # data_ptr 16-byte aligned (torch allocations are) vs off by one
    assert buf.data_ptr() % 16 == 0
    assert _key(aligned) != _key(shifted)
    assert _key(aligned) != _key(aligned.view(torch.int8))  # dtype -> pointer type
    assert _key(1) != _key(2)  # ints equal to 1
    assert _key(16) == _key(4096) and _key(16) != _key(24)  # divisibility by 16
    assert _key(2**31 - 16) != _key(2**31)  # int32 vs int64
    assert _key(2**63) != _key(2**62)  # int64 vs uint64
    assert _key(True) != _key(1) and _key(1.0) != _key(1)
    assert _key(aligned, BLOCK=64) != _key(aligned, BLOCK=128)  # constexprs by value
    assert _key(aligned, num_warps=4) != _key(aligned, num_warps=8)
    assert launch_key((aligned,), {}, 0) != launch_key((aligned,), {}, 1)  # device
    assert _key(16, 16) != _key(16)  # number of positional arguments


def _plain_kernel(x_ptr, n, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = True):  # noqa: F821
    pass


class _Compiled:
    run = function = packed_metadata = launch_metadata = None


def test_entry_tail_is_constexprs_in_declaration_order_with_defaults():
    kernel = jit.JITFunction(_plain_kernel)
    entry = _make_entry(kernel, _Compiled(), (torch.zeros(1), 5), {"BLOCK": 64, "num_warps": 4})
    assert entry is not None and entry.tail == (64, True)
    entry = _make_entry(kernel, _Compiled(), (torch.zeros(1), 5), {"FLAG": False, "BLOCK": 32})
    assert entry.tail == (32, False)


def test_entry_refused_when_the_tail_would_freeze_values():
    kernel = jit.JITFunction(_plain_kernel)
    x = torch.zeros(1)
    assert _make_entry(kernel, _Compiled(), (x,), {"n": 5, "BLOCK": 64}) is None  # runtime arg by keyword
    assert _make_entry(kernel, _Compiled(), (x, 5, 64), {}) is None  # constexpr passed positionally
    assert _make_entry(kernel, None, (x, 5), {"BLOCK": 64}) is None  # nothing compiled
    assert _make_entry(kernel, object(), (x, 5), {"BLOCK": 64}) is None  # a launcher API this module lacks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct path needs compiled (CUDA) kernels")
def test_direct_launches_write_the_bytes_of_triton_launches():
    from fp8engine.kernels import cast

    if _launch._RUNTIME is None:
        pytest.skip("direct launch path off (FP8ENGINE_TRITON_FAST_LAUNCH=0 or an unknown Triton launcher API)")
    torch.manual_seed(0)
    scale = torch.full((1,), 3.0, device="cuda")
    flat = torch.randn(64 * 1024 + 8, device="cuda", dtype=torch.bfloat16)
    # aligned, shifted by one element (data_ptr % 16 == 2), a one-element tensor (n == 1), an odd size
    cases = [flat[:64 * 1024], flat[1:64 * 1024 + 1], flat[:1], flat[:1000]]
    for x in cases * 3:  # first round: Triton's path (and a new key); later rounds: direct calls
        amax = torch.zeros(1, device="cuda")
        data, _, scale_inv = cast.cast_to_fp8(x, scale, torch.float8_e4m3fn, amax)
        ref = cast.cast_to_fp8_reference(x, scale, torch.float8_e4m3fn)[0]
        assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
        assert amax.item() == x.float().abs().max().item()
        assert scale_inv.item() == pytest.approx(1 / 3.0, rel=1e-7)
    assert cached_entries(cast._cast_kernel) >= 3  # aligned/shifted/n==1 are different keys
    # the tiled kernel with a 2-D grid, transposed copy included
    x = torch.randn(192, 256, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        data, data_t, _ = cast.cast_to_fp8(x, scale, torch.float8_e5m2, None, transpose=True)
        ref = cast.cast_to_fp8_reference(x, scale, torch.float8_e5m2)[0]
        assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(data_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
