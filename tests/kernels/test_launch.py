"""``fp8engine.kernels._common.launch``: the direct launch of a kernel's compiled launcher after its first launch.

On the CPU the plumbing runs against a stand-in kernel (what is called, with which arguments, and when the direct
path is refused); on a GPU the direct launches of the real cast kernel write the same bits as Triton's own launch.
"""
import inspect

import pytest
import torch

import fp8engine.kernels._common as common


class _Param:
    def __init__(self, name, is_constexpr, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, is_constexpr, default


class _Compiled:
    """Stands in for Triton's CompiledKernel: ``run`` records the direct launches."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.direct = []

    def run(self, *args):
        self.direct.append(args)


class _Kernel:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](*args, **meta)`` records Triton-path launches."""

    def __init__(self, params):
        self.params, self.compiled, self.triton = params, _Compiled(), []

    def __getitem__(self, grid):
        def runner(*args, **meta):
            self.triton.append((grid, args, meta))
            return self.compiled
        return runner


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "FAST_LAUNCH", True)
    monkeypatch.setattr(common, "_LAUNCHES", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)


def _kernel():
    return _Kernel([_Param("x_ptr", False), _Param("n", False), _Param("BLOCK", True),
                    _Param("FLAG", True, default=False)])


def test_first_launch_through_triton_then_direct(fake_gpu):
    k = _kernel()
    x = torch.zeros(64)
    common.launch(k, (3,), x, 48, BLOCK=128, num_warps=4)
    assert len(k.triton) == 1 and k.compiled.direct == []
    common.launch(k, (5, 2), x, 96, BLOCK=128, num_warps=4)  # same specialization: 96 and 48 both divide by 16
    assert len(k.triton) == 1
    # grid padded to 3-D, the current stream, no launch metadata or hooks, the arguments (a tensor as its pointer)
    # then the constexpr values (the passed BLOCK, FLAG's default) in parameter order
    assert k.compiled.direct == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), 96, 128, False)]


def test_cached_entry_of_another_kernel_with_the_same_id_is_not_used(fake_gpu):
    """The cache keys kernels by id; an entry whose kernel is another object (an id reused after the first kernel
    was freed) must not launch: the launch goes through Triton and replaces the entry."""
    k, other = _kernel(), _kernel()
    x = torch.zeros(64)
    common.launch(other, (1,), x, 48, BLOCK=128)
    (key, entry), = common._LAUNCHES.items()
    common._LAUNCHES.clear()
    common._LAUNCHES[(id(k),) + key[1:]] = entry  # as if ``other`` had had k's id
    common.launch(k, (1,), x, 48, BLOCK=128)
    assert len(k.triton) == 1 and other.compiled.direct == []
    common.launch(k, (1,), x, 48, BLOCK=128)  # the replaced entry is k's own
    assert len(k.triton) == 1 and len(k.compiled.direct) == 1


@pytest.mark.parametrize("second", [
    dict(n=40),                      # 40 is not a multiple of 16: another specialization
    dict(n=1),                       # Triton specializes an int equal to 1
    dict(n=2**31),                   # 64-bit int
    dict(offset=1),                  # pointer not 16-byte aligned
    dict(dtype=torch.float16),       # another pointer type
    dict(meta=dict(BLOCK=256, num_warps=4)),
    dict(meta=dict(BLOCK=128, num_warps=8)),
])
def test_other_specialization_goes_through_triton(fake_gpu, second):
    k = _kernel()
    x = torch.zeros(64)
    common.launch(k, (1,), x, 48, BLOCK=128, num_warps=4)
    y = x.to(second.get("dtype", x.dtype))[second.get("offset", 0):]
    common.launch(k, (1,), y, second.get("n", 48), **second.get("meta", dict(BLOCK=128, num_warps=4)))
    assert len(k.triton) == 2 and k.compiled.direct == []


def test_runtime_parameter_by_keyword_never_direct(fake_gpu):
    """A non-constexpr parameter passed by keyword would change per call while the direct call bakes the tail in:
    such launches always take Triton's path."""
    k = _kernel()
    x = torch.zeros(64)
    for _ in range(3):
        common.launch(k, (1,), x, n=48, BLOCK=128)
    assert len(k.triton) == 3 and k.compiled.direct == []


def test_switched_off(fake_gpu, monkeypatch):
    monkeypatch.setattr(common, "FAST_LAUNCH", False)
    k = _kernel()
    for _ in range(3):
        common.launch(k, (1,), torch.zeros(64), 48, BLOCK=128)
    assert len(k.triton) == 3 and k.compiled.direct == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton launcher)")
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", [(192, 256), (1, 16), (1151, 24)])  # (1, 16): Triton specializes M == 1
def test_direct_launch_bits_equal_triton_launch_cuda(transpose, shape, monkeypatch):
    from fp8engine.kernels.cast import cast_to_fp8, cast_to_fp8_reference

    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    scale = torch.tensor([448.0 / 5], device="cuda")
    ref = cast_to_fp8_reference(x, scale, torch.float8_e4m3fn, transpose=transpose)
    monkeypatch.setattr(common, "_LAUNCHES", {})
    for i in range(3):  # the first launch through Triton, the next two direct
        amax = torch.zeros(1, device="cuda")
        data, data_t, scale_inv = cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=transpose)
        assert torch.equal(data.view(torch.uint8), ref[0].view(torch.uint8)), f"launch {i}"
        if transpose:
            assert torch.equal(data_t.view(torch.uint8), ref[1].view(torch.uint8)), f"launch {i}"
        assert torch.equal(scale_inv, ref[2]) and amax.item() == x.abs().max().float().item()
    assert any(v for v in common._LAUNCHES.values()), "no launch took the direct path"


def test_cdiv_and_next_power_of_2_match_triton():
    """The launch-grid helpers that replace Triton's (a JIT-call wrapper per call) give the same integers."""
    triton = pytest.importorskip("triton")
    for a in range(0, 600):
        for b in (1, 3, 16, 64, 128):
            assert common.cdiv(a, b) == (a + b - 1) // b
    for n in range(1, 5000):
        assert common.next_power_of_2(n) == triton.next_power_of_2(n)
