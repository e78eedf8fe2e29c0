"""``python -m fp8engine.bench lm_loss``: the LM head + cross-entropy alone, every backend side by side.

For each ``tokens x hidden x vocab`` shape (defaults: gpt2-124m's 16 x 1024 tokens at width 768, 1b's 4 x 2048 at
2048, both on GPT-2's vocabulary 50304, and 1b's at Llama 3's 128256) and each backend of
:func:`fp8engine.ops.lm_head.lm_head_cross_entropy` (``unfused``: logits materialized, fp32 cross-entropy;
``chunked``: ours; ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropy``; ``cce``: cut-cross-entropy's
``linear_cross_entropy``), it times forward + backward under ``torch.autocast(bfloat16)`` with the fp32 weight
of training (median over ``--iters`` after 3 warm-up calls), and reports the peak memory above the inputs and the
difference of the loss and of both gradients from the first backend's (relative L2). A backend that cannot run
(not installed, no CUDA) gets its error in the row.
"""
from __future__ import annotations

import statistics
import time

import torch

from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, print_table, write_json

BACKENDS = ("unfused", "chunked", "liger", "cce")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _run(tokens: int, hidden: int, vocab: int, backend: str, device: str, iters: int, ref):
    from fp8engine.ops.lm_head import lm_head_cross_entropy

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).requires_grad_()
    target = torch.randint(0, min(vocab, 50257), (tokens,), device=device, generator=g)

    def step():
        x.grad = w.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = lm_head_cross_entropy(x, w, target, backend)
        loss.backward()
        return loss

    for _ in range(3):
        step()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    out = (loss.detach().float(), x.grad.detach().clone(), w.grad.detach().clone())
    row = {"tokens x hidden x vocab": f"{tokens}x{hidden}x{vocab}", "backend": backend,
           "ms fwd+bwd": statistics.median(times) * 1e3, "extra peak GiB": peak}
    if ref is not None:
        row.update({"loss diff": float(out[0] - ref[0]), "rel dX": _rel(out[1], ref[1]), "rel dW": _rel(out[2], ref[2])})
    return row, out


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench lm_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16384x768x50304,8192x2048x50304,8192x2048x128256",
                   help="comma-separated tokens x hidden x vocab")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or args.iters < 1:
        p.error(f"unknown backends {bad} or --iters < 1; backends: {', '.join(BACKENDS)}")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
        assert all(len(s) == 3 for s in shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes must be comma-separated TxHxV triples; got {args.shapes!r}")
    print(f"# LM head + cross-entropy fwd+bwd  {env_info()}", flush=True)
    rows, failed = [], False
    for shape in shapes:
        ref = None
        for backend in backends:
            try:
                row, out = _run(*shape, backend, args.device, args.iters, ref)
                ref = ref or out
            except Exception as err:  # noqa: BLE001 -- reported in the row, never hidden
                row = {"tokens x hidden x vocab": "x".join(map(str, shape)), "backend": backend,
                       "error": f"{type(err).__name__}: {err}".splitlines()[0][:160]}
                failed = True
            rows.append(row)
            print(f"  {row}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, ["tokens x hidden x vocab", "backend", "ms fwd+bwd", "extra peak GiB", "loss diff", "rel dX",
                       "rel dW", "error"])
    write_json(args.json, "lm_loss", rows)
    return 1 if failed else 0
