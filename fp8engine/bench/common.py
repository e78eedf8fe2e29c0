"""Timing and reporting helpers shared by the benchmarks.

Timings use CUDA events around the region, after warm-up, and report the median of ``iters`` repetitions
(the method of ../shared/ANCHORS.md). On CPU they fall back to ``time.perf_counter`` so the code path runs
everywhere, but only GPU numbers go into docs/benchmarks.md.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Sequence

import torch

__all__ = ["time_fn", "time_back_to_back", "host_us_per_call", "peak_memory_gib", "print_table", "write_json", "env_info"]


def time_fn(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10, device: str = "cuda") -> float:
    """Median wall time of ``fn()`` in milliseconds.

    On CUDA each repetition is bracketed by CUDA events (asynchronous work is counted, host gaps too);
    elsewhere by ``time.perf_counter``. ``warmup`` calls run first and are discarded.
    """
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_back_to_back(fn: Callable[[], object], *, steps: int = 5, repeats: int = 10, warmup: int = 3,
                      device: str = "cuda") -> float:
    """Milliseconds per call of ``fn()`` when ``steps`` calls are issued back to back (no synchronisation between
    them, as consecutive training steps run): median over ``repeats`` of (CUDA-event time of the run) / steps.

    :func:`time_fn` synchronises before every call, so each call also pays the host time until its first kernels
    reach the GPU; here that host time overlaps the previous call's GPU work.
    """
    if not (device == "cuda" and torch.cuda.is_available()):
        return time_fn(fn, warmup=warmup, iters=repeats, device=device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def host_us_per_call(fn: Callable[[], object], *, calls: int = 200, warmup: int = 20,
                     sleep_cycles: int = 300_000_000) -> float:
    """Host microseconds per call of ``fn()`` on CUDA: ``warmup`` calls, then ``calls`` calls timed with
    ``time.perf_counter`` while a ``torch.cuda._sleep`` kernel keeps the GPU busy, so the host never waits for it
    (``sleep_cycles`` GPU clock cycles must outlast the calls' host time)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def peak_memory_gib(reset: bool = False) -> float:
    """Peak CUDA memory allocated since the last reset, GiB (0.0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    value = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return value


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Print ``rows`` (dicts) as a Markdown table and return the text."""
    if not rows:
        return ""
    # every key of every row, in first-seen order (an error row has other keys than a timed one)
    columns = list(columns or dict.fromkeys(k for row in rows for k in row))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def env_info() -> dict:
    """GPU name, torch/CUDA/Triton versions and the date, for the header of a benchmark table."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def write_json(path: str | None, name: str, rows: Sequence[dict]) -> None:
    """Write ``{"env": env_info(), "name": name, "rows": rows}`` to ``path`` (no-op when ``path`` is None)."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump({"env": env_info(), "name": name, "rows": list(rows)}, f, indent=2)


def add_layer_shape_args(parser, seq: int = 128, batch: int = 1, hidden: int = 256, ffn: int = 1024,
                         heads: int = 4) -> None:
    """``--seq --batch --hidden --ffn --heads`` (a TransformerLayer's ``[s, b, h]``, ffn width and heads) on an
    ``argparse`` parser, with these defaults (the host-time tools' small layer)."""
    for name, default in (("seq", seq), ("batch", batch), ("hidden", hidden), ("ffn", ffn), ("heads", heads)):
        parser.add_argument(f"--{name}", type=int, default=default)


def fwd_bwd_step(model, x, dy, recipe=None, amax_group=None, **fwd_kwargs):
    """A closure running one forward + backward of ``model`` on ``x`` with output gradient ``dy``, inside
    ``fp8engine.autocast(recipe=recipe, amax_group=amax_group)`` when ``recipe`` is given (bf16/fp32 otherwise);
    gradients are reset to None first, as a training step does. ``fwd_kwargs`` go to ``model`` (e.g.
    ``is_first_microbatch``)."""
    import fp8engine as fe

    params = list(model.parameters())  # listed once: the module walk is not part of a training step's work

    def run():
        x.grad = None
        for p in params:
            p.grad = None
        if recipe is None:
            y = model(x, **fwd_kwargs)
        else:
            with fe.autocast(recipe=recipe, amax_group=amax_group):
                y = model(x, **fwd_kwargs)
        y.backward(dy)
    return run


def cuda_graph_step(step, warmup: int = 3):
    """Capture the closure ``step`` (e.g. :func:`fwd_bwd_step`'s) in one CUDA graph after ``warmup`` eager runs
    on a side stream (kernels compile, FP8 histories and gradients exist), as the training command captures its
    step; returns a closure that replays it. Collectives inside (NCCL) are captured and replayed too."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
