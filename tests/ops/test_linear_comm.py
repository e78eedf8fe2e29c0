"""The linear and MLP ops call their tensor-parallel communication (a ``LinearComm``) at Megatron-core's points:
fprop's input gathered (FP8 shard kept for backward), the shard re-gathered before the dgrad GEMM, the dgrad
communication started right after the dgrad GEMM and waited for only after the wgrad GEMM.

One process: the fake communication below is a group of one rank (every collective is the identity) that records
what the op asks for, so the results must also equal the op without communication bit for bit."""
import pytest
import torch

from _ops_test_utils import make_state
import fp8engine.ops.linear as linear_mod
from fp8engine.ops.linear import LINEAR_ROLES, fp8_linear, linear
from fp8engine.ops.mlp import MLP_ROLES, _unfused_fp8_mlp, fp8_mlp


class _Work:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def wait(self):
        self.log.append(f"wait {self.what}")


class RecordingComm:
    """A one-rank ``LinearComm`` recording its calls into ``log`` (shared with the patched GEMMs)."""

    def __init__(self, log, parallel_mode, sequence_parallel):
        self.log = log
        self.gathers_input = parallel_mode == "column" and sequence_parallel
        self.reduces_output = parallel_mode == "row"
        self.column = parallel_mode == "column"

    def gather_input(self, x, quantizer, transpose):
        self.log.append("gather_input " + ("fp8" if quantizer is not None else "hp"))
        if quantizer is None:
            return x, x
        local = quantizer.quantize(x)  # the FP8 all-gather: shard cast, no transpose kept
        return local, local

    def regather_input(self, shard):
        self.log.append("start regather")

        def finish():
            self.log.append("wait regather")
            return shard

        return finish

    def start_dgrad_comm(self, dx):
        if not self.column:
            return dx, None
        self.log.append("start dgrad comm")
        return dx, _Work(self.log, "dgrad comm")

    def reduce_output(self, y):
        if self.reduces_output:
            self.log.append("reduce output")
        return y

    def gather_output_grad(self, dy):
        if self.reduces_output:
            self.log.append("gather output grad")
        return dy


@pytest.fixture
def gemm_log(monkeypatch):
    """Record every backward GEMM of ``ops.linear`` (dgrad and wgrad go through ``fp8_mm``)."""
    log = []
    real = linear_mod.fp8_mm

    def recording(a, a_scale_inv, b, b_scale_inv, out_dtype, **kw):
        log.append("gemm " + ("wgrad" if kw.get("pad_inner") else "dgrad"))
        return real(a, a_scale_inv, b, b_scale_inv, out_dtype, **kw)

    monkeypatch.setattr(linear_mod, "fp8_mm", recording)
    return log


def _inputs(seed=0, rows=(6, 5), k=48, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, k, generator=g).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.2).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(*rows, n, generator=g)
    return x, w, b, dy


def _run_linear(delayed, comm):
    x, w, b, dy = _inputs()
    _, qs = make_state(LINEAR_ROLES, delayed)
    y = fp8_linear(x, w, b, qs[0], comm=comm)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("delayed", [True, False], ids=["delayed", "current"])
def test_column_sequence_parallel_order(gemm_log, delayed):
    want = _run_linear(delayed, None)
    gemm_log.clear()
    got = _run_linear(delayed, RecordingComm(gemm_log, "column", sequence_parallel=True))
    # the re-gather overlaps the dgrad GEMM, the dgrad communication overlaps the wgrad GEMM
    assert gemm_log == ["gather_input fp8", "start regather", "gemm dgrad", "start dgrad comm", "wait regather",
                        "gemm wgrad", "wait dgrad comm"]
    for a, b in zip(got, want):  # one rank: the same bits as no communication
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_column_all_reduce_order(gemm_log):
    want = _run_linear(True, None)
    gemm_log.clear()
    got = _run_linear(True, RecordingComm(gemm_log, "column", sequence_parallel=False))
    assert gemm_log == ["gemm dgrad", "start dgrad comm", "gemm wgrad", "wait dgrad comm"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_row_parallel_reduces_then_adds_bias(gemm_log, sp):
    want = _run_linear(True, None)
    gemm_log.clear()
    got = _run_linear(True, RecordingComm(gemm_log, "row", sequence_parallel=sp))
    assert gemm_log == ["reduce output", "gather output grad", "gemm dgrad", "gemm wgrad"]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[1:3], want[1:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-6)  # db: another fp32 summation order


def test_high_precision_op_with_comm_matches_f_linear(gemm_log):
    x, w, b, dy = (t.detach().double() for t in _inputs())
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    log = []
    y = linear(x, w, b, comm=RecordingComm(log, "column", sequence_parallel=True))
    y.backward(dy)
    assert log == ["gather_input hp", "start regather", "start dgrad comm", "wait regather", "wait dgrad comm"]
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(xr, wr, br).backward(dy)
    for a, r in ((y, torch.nn.functional.linear(xr, wr, br)), (x.grad, xr.grad), (w.grad, wr.grad),
                 (b.grad, br.grad)):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_an_input_cast_before_the_gather_is_refused():
    x, w, b, _ = _inputs()
    _, qs = make_state(LINEAR_ROLES, True)
    x_fp8 = qs[0].input.quantize(x.detach().reshape(-1, 48))
    with pytest.raises(ValueError, match="cannot be all-gathered"):
        fp8_linear(x, w, b, qs[0], x_fp8=x_fp8, comm=RecordingComm([], "column", sequence_parallel=True))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_mlp_op_communicates_like_two_linears(gemm_log, fused, sp):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, 32, generator=g)
    w1, w2 = torch.randn(64, 32, generator=g) * 0.2, torch.randn(32, 64, generator=g) * 0.2
    b1, b2 = torch.randn(64, generator=g), torch.randn(32, generator=g)
    dy = torch.randn(4, 5, 32, generator=g)
    mlp = fp8_mlp if fused else _unfused_fp8_mlp

    def run(comms):
        params = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        _, qs = make_state(MLP_ROLES, True)
        y = mlp(params[0], *params[1:3], *params[3:5], "gelu", qs[0], qs[1], fc1_comm=comms[0], fc2_comm=comms[1])
        y.backward(dy)
        return [y.detach()] + [p.grad for p in params]

    want = run((None, None))
    gemm_log.clear()
    got = run((RecordingComm(gemm_log, "column", sp), RecordingComm(gemm_log, "row", sp)))
    fc1 = (["start regather", "gemm dgrad", "start dgrad comm", "wait regather", "gemm wgrad", "wait dgrad comm"]
           if sp else ["gemm dgrad", "start dgrad comm", "gemm wgrad", "wait dgrad comm"])
    assert gemm_log == (["gather_input fp8"] if sp else []) + ["reduce output", "gather output grad",
                                                               "gemm dgrad", "gemm wgrad"] + fc1
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 5:  # db2: this rank's rows summed apart from the dy cast (another fp32 summation order)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
