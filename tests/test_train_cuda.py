"""The training command on a GPU, exactly as users run it: fp32 master parameters, ``torch.autocast(bfloat16)``
around the FP8 region, every precision and recipe, eager and with the step captured in a CUDA graph.

These guard the main job on CUDA (a GPU-only crash once went unnoticed because no test ran the command there);
they skip on machines without a GPU. The CPU-side behaviour of the step objects is tested at the end.
"""
import json

import pytest
import torch

from fp8engine.train import main
from fp8engine.training.step import CUDAGraphStep, capture_problem, graph_warmup, set_lr

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: A GPT small enough for seconds per run, FP8-shaped (multiples of 16), with dropout so that the RNG matters.
_SMALL = ["--model", "tiny", "--n-layer", "2", "--hidden-size", "256", "--n-head", "4", "--ffn-hidden-size", "1024",
          "--seq-len", "256", "--batch-size", "8", "--eval-iters", "2", "--sample-tokens", "16", "--device", "cuda",
          "--dropout", "0.1"]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(out, *extra) -> list[float]:
    assert main([*_SMALL, "--out", str(out), *extra]) == 0
    return _losses(out)


@cuda
@pytest.mark.parametrize("precision,recipe", [("fp8", "delayed"), ("fp8", "current"), ("bf16", "delayed"),
                                              ("fp32", "delayed")])
def test_graphed_run_logs_the_eager_losses(tmp_path, precision, recipe):
    """The captured step replays the eager kernels on the same memory, with the same fused AdamW and dropout
    offsets: the logged losses are equal bit for bit, and training lowers the loss."""
    flags = ["--precision", precision, "--recipe", recipe, "--steps", "12", "--eval-interval", "6"]
    graphed = _run(tmp_path / "graph", *flags)
    eager = _run(tmp_path / "eager", *flags, "--no-cuda-graphs")
    assert graphed == eager
    assert all(torch.isfinite(torch.tensor(graphed)))
    assert graphed[-1] < graphed[0] - 0.5  # from ~ln(256) = 5.5: 12 steps at lr 3e-3 take off more than 0.5


@cuda
def test_graphed_gradient_accumulation_matches_eager(tmp_path):
    """``--grad-accum 2`` captures both micro-batches (FP8 weight cast on the first, cached on the second)."""
    flags = ["--steps", "8", "--eval-interval", "8", "--grad-accum", "2"]
    assert _run(tmp_path / "graph", *flags) == _run(tmp_path / "eager", *flags, "--no-cuda-graphs")


@cuda
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_graphed_resume_is_exact(tmp_path, recipe):
    """Stopped at step 5 and resumed (capture again after two eager steps) == uninterrupted, loss for loss."""
    flags = ["--recipe", recipe, "--steps", "10", "--eval-interval", "5"]
    full = _run(tmp_path / "full", *flags)
    _run(tmp_path / "split", *flags, "--stop-at", "5")
    assert _run(tmp_path / "split", *flags, "--resume") == full


@cuda
def test_graphed_run_with_fp8_stats_matches_eager(tmp_path):
    """``--fp8-stats 3``: steps 3, 6, 9 run eagerly outside the graph (step 3 before the capture, 6 and 9 between
    replays) with the counting on; the graphed run logs the eager run's losses and stats rows exactly."""
    flags = ["--steps", "10", "--eval-interval", "5", "--fp8-stats", "3"]
    logs = {}
    for name, extra in (("graph", []), ("eager", ["--no-cuda-graphs"])):
        assert main([*_SMALL, "--out", str(tmp_path / name), *flags, *extra]) == 0
        logs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert (tmp_path / name / "fp8_health.png").exists()
    graph, eager = logs["graph"], logs["eager"]
    assert [r["step"] for r in graph if "fp8_stats" in r] == [3, 6, 9]
    assert [r["loss"] for r in graph] == [r["loss"] for r in eager]
    assert [r.get("fp8_stats") for r in graph] == [r.get("fp8_stats") for r in eager]
    assert all(row["underflow_pct"] is not None for r in graph if "fp8_stats" in r for row in r["fp8_stats"])


@cuda
def test_graphed_nonfinite_steps_change_nothing(tmp_path):
    """lr 1e30 without warm-up: step 1 is finite and moves the weights to ~1e30, steps 2-6 overflow (step 2
    eager, 3 captured, 4-6 replayed). With --skip-nonfinite 5 the guard inside the graph (flat FP8-buffer
    snapshot, found_inf into the fused AdamW, conditional restore) leaves weights, every FP8 scaling buffer and
    the AdamW state exactly as step 1 left them: the end checkpoint equals that of a run stopped at step 1."""
    flags = ["--steps", "6", "--eval-interval", "6", "--lr", "1e30", "--warmup-steps", "0", "--weight-decay", "0"]
    _run(tmp_path / "good", *flags, "--stop-at", "1")
    _run(tmp_path / "skip", *flags, "--skip-nonfinite", "5")
    records = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False] + [True] * 5
    good = torch.load(tmp_path / "good" / "checkpoint.pt", map_location="cpu", weights_only=False)
    skip = torch.load(tmp_path / "skip" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert skip["step"] == 6 and any(k.endswith("amax_history") for k in good["model"])
    for key, value in good["model"].items():
        torch.testing.assert_close(skip["model"][key], value, rtol=0, atol=0, msg=key)
    for pid, state in good["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(skip["optimizer"]["state"][pid][key], value, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_fp8_run_logs_close_to_eager(tmp_path, recipe):
    """``--compile`` (Inductor, bf16 autocast around the FP8 region) against eager, dropout off (Inductor draws its
    own masks). Inductor's fused kernels round bf16 intermediates once where eager mode rounds per op, and FP8
    amplifies such differences (tests/compile/test_compile_inductor.py). Measured on an H100 (torch 2.11): the first
    7 steps within 2.5e-3 (both recipes); after that, at lr 3e-3 on this small model, the eager current-scaling
    run had a loss spike at step 8 (3.05 -> 3.27) that the compiled run did not (6.6e-2 apart, 2e-2 by step 12),
    while delayed scaling stayed within 2.5e-3 throughout. Bounds (at first): the first 7 steps within 5e-3 (the
    delayed-scaling bug fixed by fp8engine.fp8.library.frozen_scale moved losses by 2.6e-2 at step 2, 8e-2 at 4), all 12 within
    1e-1, and the compiled run learns. With the compiled step captured in the CUDA graph and the cast / norm kernels
    as custom ops (H100, torch 2.11), delayed scaling measured 5.6e-3 at step 5 and at most 1.7e-3 at the other
    steps; with fc1's cuBLASLt GELU epilogue as a custom op too (the compiled fc1 + GELU then equals eager's bit for
    bit: tests/compile/test_gemm_ops.py), 2.3e-2 at step 5 and at most 2.9e-3 at steps 1-4 and 6-7: step 5 is where
    this run amplifies small differences. With the master weights drawn on the GPU (another initialisation), current
    scaling (H200, torch 2.11): steps 1-4 within 3.9e-4, one spike at step 6 (1.7e-1: one run's loss jumped, the
    other's did not), steps 7-12 within 2.2e-2 again. Bounds: steps 1-4 within 5e-3 (the frozen_scale bug: 2.6e-2
    at step 2, 8e-2 at step 4); one step of the 12 may spike, but the median and the last step stay within 2e-2
    and 5e-2 (a compiled step that computes something else drifts at every step)."""
    flags = ["--precision", "fp8", "--recipe", recipe, "--steps", "12", "--eval-interval", "6", "--dropout", "0"]
    compiled = torch.tensor(_run(tmp_path / "compiled", *flags, "--compile"))
    eager = torch.tensor(_run(tmp_path / "eager", *flags, "--no-cuda-graphs"))
    rel = (compiled / eager - 1).abs()
    assert rel[:4].max() < 5e-3 and rel.median() < 2e-2 and rel[-1] < 5e-2, rel
    assert compiled[-1] < compiled[0] - 0.5


@cuda
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_graphed_run_logs_the_compiled_losses(tmp_path, recipe):
    """``--compile`` on CUDA captures the compiled step in the command's CUDA graph (after 3 eager steps): the
    replays run the compiled step's own kernels on the same buffers, dropout masks drawn from the CUDA generator
    (whose offset a replay advances as the eager step does). Against ``--compile --no-cuda-graphs``, not bit for
    bit: two compiled runs differ even in their eager steps (Inductor's generated reductions may accumulate with
    atomic adds, whose order varies between runs). Measured on an H100 (torch 2.11): delayed scaling first differed
    at step 4, by 2e-6, in another run at step 3 by 4e-6, growing to 6e-5 by step 6 and 1.1e-4 by step 8 (2026-11-27);
    on an H200 beside the rest of the suite 4.2e-4 at step 5 and 5.2e-4 by step 8 (2026-11-28; bound 8e-4, still under
    the 1e-3 a change of dropout masks makes, asserted below); current scaling at step 3 (eager in both runs), by
    4e-5, growing to 5.3e-4 by step 5 (current scaling's just-in-time scales pass the difference on), on an H200
    beside the suite 2.6e-3 at step 5 (2026-11-28; bound 5e-3). A replay that reused one
    dropout mask, or skipped the scale update, would be off by far more: under delayed scaling the same run with
    dropout 0 moves the losses by more than 1e-3 (asserted), so that bound tells masks apart."""
    flags = ["--precision", "fp8", "--recipe", recipe, "--steps", "8", "--eval-interval", "4", "--compile"]
    graphed = torch.tensor(_run(tmp_path / "graph", *flags, "--dropout", "0.1"))
    eager = torch.tensor(_run(tmp_path / "eager", *flags, "--dropout", "0.1", "--no-cuda-graphs"))
    if recipe == "delayed":
        no_dropout = torch.tensor(_run(tmp_path / "p0", *flags, "--dropout", "0", "--no-cuda-graphs"))
    assert (graphed / eager - 1).abs().max() < (8e-4 if recipe == "delayed" else 5e-3), (graphed, eager)
    if recipe == "delayed":
        assert (no_dropout / eager - 1)[3:].abs().max() > 1e-3


@cuda
def test_gpt_forward_backward_as_the_command_runs_it():
    """fp32 parameters, bf16 autocast around the FP8 region: finite loss and gradients for every parameter, and
    the FP8 loss within 0.05 of the bf16 one at init (both ~ln(256); FP8 adds per-tensor quantisation noise)."""
    import fp8engine
    from fp8engine.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256, max_seq_len=128), device="cuda")
    tokens = torch.randint(0, 256, (4, 128), device="cuda")
    losses = {}
    for name, recipe in [("bf16", None), ("delayed", fp8engine.DelayedScaling()),
                         ("current", fp8engine.CurrentScaling())]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with fp8engine.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                loss = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        losses[name] = loss.item()
    assert abs(losses["delayed"] - losses["bf16"]) < 0.05 and abs(losses["current"] - losses["bf16"]) < 0.05


def test_capture_problem_says_why():
    assert capture_problem(torch.device("cpu"), False) == "CUDA graphs need --device cuda"
    assert capture_problem(torch.device("cuda"), True) is None  # a compiled step is captured too
    assert capture_problem(torch.device("cuda"), False) is None  # multi-process runs too (tp, sp, dp)


def test_graph_warmup_gives_compile_its_retrace():
    assert graph_warmup(False) == 2 and graph_warmup(True) == 3


def test_graph_step_refuses_cpu_parameters():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="CUDA parameters"):
        CUDAGraphStep(p, [p], torch.optim.SGD([p], lr=1.0), lambda: None, 1, lambda ps: None)


def test_set_lr_fills_in_place_and_moves_a_loaded_lr_to_the_parameters_device():
    """A checkpoint loaded with map_location="cpu" leaves tensor learning rates on the CPU; fused AdamW would read
    them as host scalars, frozen into a CUDA graph at capture (a resumed graphed run then drifted from step 9)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.5))
    lr = opt.param_groups[0]["lr"]
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.25  # same tensor: a captured step reads it
    on_meta = torch.nn.Parameter(torch.zeros(2, device="meta"))  # stands in for a CUDA parameter
    opt = torch.optim.AdamW([on_meta], lr=torch.tensor(0.5))
    set_lr(opt, 0.125)
    assert opt.param_groups[0]["lr"].device.type == "meta"
