"""``python -m fp8engine.bench train``: the training command's real step, every precision side by side.

For each model and mode it builds the run exactly as ``python -m fp8engine.train`` does (same parser, model,
optimizer, precision context, step object: :func:`fp8engine.train.make_step`) and times whole optimizer steps the
way the command runs them (learning rate set, batch built on the host, forward + backward + clip + AdamW + FP8
scale update, loss read back). Reported per mode: median step time over the timed steps, tokens/s, model TFLOP/s
and MFU against the GPU's dense bf16 peak, peak memory, and the ratio of tokens/s to bf16 eager.

Modes: ``bf16`` (eager), ``bf16-compile`` (``--compile --no-cuda-graphs``: ``torch.compile``'s default),
``bf16-graph`` (CUDA graph), ``bf16-compile-graph`` (compiled and captured), ``fp8-delayed`` and ``fp8-current``
(eager, ``--no-cuda-graphs``; ``fp8-delayed-layers``: eager with ``--no-fused-layer``, each layer's sublayers
one by one), ``fp8-delayed-graph`` and ``fp8-current-graph`` (the command's default on CUDA),
``fp8-delayed-compile`` and ``fp8-current-compile`` (``--compile --no-cuda-graphs``: Inductor; its first steps,
which compile, fall in the skipped warm-up), ``fp8-*-compile-graph`` (``--compile`` on CUDA: the compiled step
captured in the command's CUDA graph), ``fp8-block`` and ``fp8-block-graph``; under ``--fsdp``
``fp8-delayed-fp8-gather`` all-gathers the FP8 weights as FP8 bytes (``fp8-delayed``: in bf16). Peers, the same GPT in plain
PyTorch (:mod:`fp8engine.bench.plain_gpt`): ``plain-bf16``, ``plain-bf16-compile`` and ``torchao-fp8-compile``
(torchao.float8, with its FP8 all-gather under ``--fsdp``). Model FLOPs per token: ``6 N + 12 L h s`` (N =
non-embedding parameters plus the tied LM head, L layers, h width, s context; the PaLM paper's appendix B
formula), so MFU counts no recomputation.

Data: by default token bins of random GPT-2 ids (< 50257, vocabulary padded to 50304: the vocabulary users train
``gpt2-124m`` and ``1b`` with; random ids time the same GEMMs and loss as real text), written once to a
temporary directory; ``--vocab bytes`` uses the training command's default byte data (vocabulary 256, a labelled
extra); ``--data`` any data of the command.

Multi-GPU: launched with ``torchrun --nproc-per-node N``, every mode runs on all N processes in the layout of
``--tp T [--sequence-parallel]`` (``N / T`` data-parallel replicas, each with ``--batch-size`` micro-batches):
exactly the command's multi-process step (CUDA graphs included, where the command captures). Step times are rank
0's; tokens/s counts the whole global batch; ``tokens_per_s_per_gpu`` divides it by N. Only rank 0 prints.

Each step runs with the command's non-finite guard (:mod:`fp8engine.training.guard`: FP8-buffer snapshot,
device-side check, ``found_inf`` read with the loss); ``--no-guard`` times the step without it. ``--guard-cost``
measures the guard's cost in one process instead: per mode one model, a step object with and one without the
guard, timed in alternating blocks (two separate processes differ by more than the cost).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch

from fp8engine._cli import CommandParser
from fp8engine.bench.common import env_info, peak_memory_gib, print_table, write_json
from fp8engine.bench.plain_gpt import PEER_MODES

__all__ = ["main", "MODES", "model_flops_per_token"]

#: mode -> extra training-command flags.
MODES = {
    "bf16": ["--precision", "bf16", "--no-cuda-graphs"],
    "bf16-compile": ["--precision", "bf16", "--compile", "--no-cuda-graphs"],
    "bf16-compile-graph": ["--precision", "bf16", "--compile"],
    "bf16-graph": ["--precision", "bf16"],
    "fp8-delayed": ["--precision", "fp8", "--recipe", "delayed", "--no-cuda-graphs"],
    "fp8-delayed-graph": ["--precision", "fp8", "--recipe", "delayed"],
    "fp8-delayed-fp8-gather": ["--precision", "fp8", "--recipe", "delayed", "--no-cuda-graphs",
                               "--fp8-all-gather"],
    "fp8-delayed-layers": ["--precision", "fp8", "--recipe", "delayed", "--no-cuda-graphs", "--no-fused-layer"],
    "fp8-current": ["--precision", "fp8", "--recipe", "current", "--no-cuda-graphs"],
    "fp8-current-graph": ["--precision", "fp8", "--recipe", "current"],
    "fp8-delayed-compile": ["--precision", "fp8", "--recipe", "delayed", "--compile", "--no-cuda-graphs"],
    "fp8-current-compile": ["--precision", "fp8", "--recipe", "current", "--compile", "--no-cuda-graphs"],
    "fp8-delayed-compile-graph": ["--precision", "fp8", "--recipe", "delayed", "--compile"],
    "fp8-current-compile-graph": ["--precision", "fp8", "--recipe", "current", "--compile"],
    "fp8-block": ["--precision", "fp8", "--recipe", "block", "--no-cuda-graphs"],
    "fp8-block-graph": ["--precision", "fp8", "--recipe", "block"],
}
#: model -> micro-batch size (the end-to-end issue's shapes: gpt2-124m 16 x 1024, 1b 4 x 2048).
BATCH = {"tiny": 16, "small": 64, "gpt2-124m": 16, "1b": 4, "8b": 1}
#: Dense bf16 peak by datasheet, TFLOP/s (H100/H200 SXM: 989), for MFU.
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, ``6 N + 12 L h s`` (PaLM, Chowdhery et al. 2022, appendix B): N counts the
    layers' and final norm's parameters and the LM head GEMM (``h * V``), not the embedding lookup."""
    h, L, f, v = config.hidden_size, config.n_layer, config.ffn_hidden_size, config.vocab_size
    kv = h // config.n_head * (config.num_gqa_groups or config.n_head)
    per_layer = h * (h + 2 * kv) + h * h + (3 if config.activation == "swiglu" else 2) * h * f
    return 6.0 * (L * per_layer + h * v) + 12.0 * L * h * seq_len


def _peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


#: Random GPT-2 token ids per split of the default data (train, val): enough for any offset of the timed steps.
_RANDOM_TOKENS = (8_000_000, 400_000)
_GPT2_IDS = 50257


def random_gpt2_bins(directory: str, seed: int = 0) -> str:
    """Write nanoGPT-style ``train.bin`` / ``val.bin`` (uint16 random ids < 50257, no ``meta.pkl``: the training
    command reads GPT-2's padded vocabulary 50304) into ``directory``; returns it."""
    import os

    import numpy as np

    rng = np.random.default_rng(seed)
    for name, n in zip(("train.bin", "val.bin"), _RANDOM_TOKENS):
        rng.integers(0, _GPT2_IDS, size=n, dtype=np.uint16).tofile(os.path.join(directory, name))
    return directory


def _setup(model_name: str, mode: str, args: argparse.Namespace):
    """The training command's run, model, step model and optimizer for ``mode`` (built as the command does)."""
    from fp8engine import train as T

    flags = MODES.get(mode, ["--precision", "bf16", "--no-cuda-graphs"])  # peers: the bf16 run's data and batch
    argv = ["--model", model_name, "--batch-size", str(args.batch_size or BATCH[model_name]),
            "--steps", str(args.steps), "--device", args.device, "--sample-tokens", "0", *flags]
    if args.seq_len:
        argv += ["--seq-len", str(args.seq_len)]
    if args.data:
        argv += ["--data", args.data]
    if args.tp > 1:
        argv += ["--tp", str(args.tp)] + (["--sequence-parallel"] if args.sequence_parallel else [])
    if args.fsdp:
        argv += ["--fsdp"]
    if args.lm_loss:
        argv += ["--lm-loss", args.lm_loss]
    argv += shlex.split(args.train_args)
    run = T.prepare(T.build_parser().parse_args(argv))
    run.layout = args.layout
    if run.device.type == "cuda":
        run.device = torch.device("cuda", torch.cuda.current_device())
    run.graph_problem = T.graph_problem(run)
    if mode in PEER_MODES:
        from fp8engine.bench.plain_gpt import build_peer

        torch.manual_seed(run.args.seed)
        model, run.peer_after_step = build_peer(mode, run.config, run.device, run.layout, run.args.fsdp)
        return run, model, model, T.make_optimizer(model, run.args.lr, run.args.weight_decay, run.device)
    return (run, *T._build(run))


def _peer_step(run, model, optimizer):
    """The command's eager step (:class:`~fp8engine.training.step.TrainStep`) for a plain PyTorch peer
    (:mod:`fp8engine.bench.plain_gpt`): micro-batches under ``torch.autocast(bf16)``, data-parallel gradient averaging
    (the command's averager; FSDP2's reduce-scatter under ``--fsdp``), clipping to norm 1, AdamW, zeroed gradients,
    then the peer's ``after_step`` (torchao's FSDP scale precompute); no non-finite guard."""
    from fp8engine.parallel.data_parallel import GradientAverager
    from fp8engine.training.distributed import clip_grad_norm
    from fp8engine.training.step import TrainStep

    layout, params = run.layout, list(model.parameters())
    averager = (GradientAverager(params, layout.dp_group, bucket_mb=100.0)
                if layout.dp_size > 1 and not run.args.fsdp else None)
    fsdp_group = layout.dp_group if run.args.fsdp else None

    class PeerStep(TrainStep):
        def _step(self, xs, ys):
            loss = super()._step(xs, ys)
            if run.peer_after_step is not None:
                run.peer_after_step()
            return loss

    return PeerStep(model, params, optimizer, lambda: torch.autocast(run.device.type, dtype=torch.bfloat16),
                    run.args.grad_accum, lambda ps: clip_grad_norm(ps, 1.0, None, fsdp_group), device=run.device,
                    grad_averager=averager)


def _timed_steps(run, step_fn, optimizer, steps: int) -> tuple[list[float], list[float]]:
    """Steps ``1..steps`` as the command's loop runs them (:func:`fp8engine.train.launch_step`: on CUDA each loss
    read once the next step is queued); returns (seconds per step: the time between two reads, losses)."""
    from fp8engine import train as T

    times, losses, pending, last = [], [], None, time.perf_counter()
    for step in range(1, steps + 2):
        launched = T.launch_step(run, step_fn, optimizer, step) if step <= steps else None
        for done in ([pending] if pending is not None else []) + \
                ([launched] if launched is not None and launched.ready is None else []):
            record, now = T.finish_step(run, done, 1, last)
            times.append(now - last)
            losses.append(record["loss"])
            last = now
        pending = launched if launched is not None and launched.ready is not None else None
    return times, losses


def _timed_step(run, step_fn, optimizer, step: int) -> tuple[float, float]:
    """One optimizer step as the command runs it (lr set, batch built, loss and ``found_inf`` read back in one
    transfer); returns (seconds, loss)."""
    from fp8engine import train as T
    from fp8engine.training.step import set_lr

    t0 = time.perf_counter()
    set_lr(optimizer, T.lr_at(step, run.args.lr, run.args.warmup_steps, run.args.steps))
    xs, ys = T.step_batches(run, step)
    loss = step_fn(xs, ys)
    if step_fn.found_inf is not None:  # as the command reads it: one transfer with the loss
        loss = torch.stack([loss.detach().float(), step_fn.found_inf])[0]
    value = loss.item()
    return time.perf_counter() - t0, value


def _release() -> None:
    """Free what one mode left behind before the next: its compiled graphs (a later model must not run against a
    Dynamo cache filled by an earlier one: gpt2-124m's bf16-compile failed with an AssertionError after the 1b modes
    in one process, H100, torch 2.11, while the same compile alone trained) and its memory."""
    import torch._dynamo

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_mode(model_name: str, mode: str, args: argparse.Namespace) -> dict:
    from fp8engine import train as T
    from fp8engine.training.step import CUDAGraphStep

    t_setup = time.perf_counter()
    run, model, step_model, optimizer = _setup(model_name, mode, args)
    step_fn = (_peer_step(run, model, optimizer) if mode in PEER_MODES
               else T.make_step(run, model, step_model, optimizer, guard=not args.no_guard))
    t_setup = time.perf_counter() - t_setup
    tokens = run.args.batch_size * run.args.seq_len * run.layout.dp_size  # the global batch of one step
    peak_memory_gib(reset=True)
    times, losses = _timed_steps(run, step_fn, optimizer, args.steps)
    timed = times[args.skip:]
    step_s = statistics.median(timed)
    flops = model_flops_per_token(run.config, run.args.seq_len) * tokens / step_s / 1e12
    peak = _peak_tflops()
    world = run.layout.world_size
    row = {"model": model_name, "mode": mode, "batch": f"{run.args.batch_size}x{run.args.seq_len}",
           "layout": _layout_name(run.layout, run.args.sequence_parallel, run.args.fsdp),
           "vocab": run.config.vocab_size,
           "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / world,
           "model_tflops": flops / world, "mfu": flops / world / peak if peak else float("nan"),
           "peak_mem_gib": peak_memory_gib(),
           "graphed": isinstance(step_fn, CUDAGraphStep), "guard": not args.no_guard and mode not in PEER_MODES,
           "setup_s": t_setup, "steps_s": sum(times), "loss_first": losses[0],
           "loss_last": losses[-1]}
    del model, step_model, optimizer, step_fn
    _release()
    return row


#: --guard-cost: steps per block; blocks of the two step objects alternate (ABBA order) so that clock and thermal
#: drift fall on both alike.
_GUARD_BLOCK = 5


def _guard_cost(model_name: str, mode: str, args: argparse.Namespace) -> dict:
    """The guard's cost in one process: one model and optimizer, two step objects (with and without the
    non-finite guard; each captured in its own CUDA graph in the ``-graph`` modes), ``args.skip`` warm-up steps
    each, then ``args.steps`` (rounded up to whole blocks) timed steps each in alternating blocks of
    ``_GUARD_BLOCK``. Returns both medians (ms) and the guard's cost in percent of the step without it."""
    from fp8engine import train as T

    run, model, step_model, optimizer = _setup(model_name, mode, args)
    step_fns = {flag: T.make_step(run, model, step_model, optimizer, guard=flag) for flag in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for flag in (True, False):  # eager warm-up and capture of each
        for _ in range(args.skip):
            step += 1
            _timed_step(run, step_fns[flag], optimizer, step)
    blocks = -(-args.steps // _GUARD_BLOCK)
    for b in range(blocks):
        for flag in ((True, False) if b % 2 == 0 else (False, True)):
            for _ in range(_GUARD_BLOCK):
                step += 1
                times[flag].append(_timed_step(run, step_fns[flag], optimizer, step)[0])
    with_guard, without = statistics.median(times[True]), statistics.median(times[False])
    row = {"model": model_name, "mode": mode, "batch": f"{run.args.batch_size}x{run.args.seq_len}",
           "guard_ms": with_guard * 1e3, "no_guard_ms": without * 1e3,
           "guard_cost_pct": (with_guard / without - 1) * 100, "steps_each": len(times[True])}
    del model, step_model, optimizer, step_fns
    _release()
    return row


def _layout_name(layout, sequence_parallel: bool, fsdp: bool = False) -> str:
    if layout.world_size == 1:
        return "1 GPU"
    parts = ([f"tp{layout.tp_size}" + ("-sp" if sequence_parallel else "")] if layout.tp_size > 1 else []) + \
        ([f"{'fsdp' if fsdp else 'dp'}{layout.dp_size}"] if layout.dp_size > 1 else [])
    return " x ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m fp8engine.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2-124m,1b", help="comma-separated model names of the training command")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}; plain "
                                                           f"PyTorch peers: {', '.join(PEER_MODES)}")
    p.add_argument("--steps", type=int, default=30, help="steps per mode (>= skip + 1)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median (warm-up, capture)")
    p.add_argument("--batch-size", type=int, help="micro-batch size (default: gpt2-124m 16, 1b 4)")
    p.add_argument("--seq-len", type=int, help="default: the model's context")
    p.add_argument("--data", help="training data as for the training command (default: random GPT-2 token bins; "
                                  "see --vocab)")
    p.add_argument("--vocab", default="gpt2", choices=("gpt2", "bytes"),
                   help="without --data: gpt2 = random ids of GPT-2's vocabulary (default), bytes = the command's "
                        "default byte data (vocabulary 256)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size under torchrun (the rest of the "
                                                     "processes are data-parallel replicas)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: sequence parallelism")
    p.add_argument("--lm-loss", choices=("chunked", "liger", "cce", "unfused"),
                   help="the command's --lm-loss for every mode (default: the command's default, chunked)")
    p.add_argument("--fsdp", action="store_true", help="the data-parallel replicas shard with FSDP2 (the command's "
                                                       "--fsdp)")
    p.add_argument("--train-args", default="", metavar="ARGS",
                   help="more options of the training command for every mode, one string (e.g. "
                        "\"--no-fsdp-reshard-after-forward --fsdp-reduce-dtype bf16\"); a bad one is a usage error")
    p.add_argument("--baseline", default="bf16", help="the mode the vs_base column divides by (default bf16)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--no-guard", action="store_true", help="time the step without the non-finite guard (compare "
                                                          "with a run without this flag for the guard's cost)")
    p.add_argument("--guard-cost", action="store_true",
                   help="instead of the table: per mode, time the step with and without the non-finite guard in "
                        "one process (same model, alternating blocks of steps) and report the difference")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES and m not in PEER_MODES] + [m for m in models if m not in BATCH]
    if unknown or args.steps < args.skip + 1 or args.skip < 0:  # usage errors: one line, exit 2
        parser.error(f"unknown model/mode {unknown} or --steps {args.steps} <= --skip {args.skip}; "
                     f"models: {', '.join(BATCH)}; modes: {', '.join(MODES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU visible; pass --device cpu to exercise the code path")
    if args.guard_cost and args.no_guard:
        parser.error("--guard-cost times both; drop --no-guard")
    if args.data and args.vocab != "gpt2":
        parser.error("--vocab picks the default data; drop it with --data")
    from fp8engine.training import UsageError
    from fp8engine.training.distributed import env_world_size, init_layout

    if env_world_size() % args.tp or (args.sequence_parallel and args.tp == 1):
        parser.error(f"--tp {args.tp} must divide the number of processes ({env_world_size()}); "
                     "--sequence-parallel needs --tp 2 or more")
    args.layout = init_layout(args.tp, torch.device(args.device))
    with contextlib.ExitStack() as stack:
        if not args.layout.is_main:  # rank 0 reports for all
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        if args.data is None and args.vocab == "gpt2":
            args.data = random_gpt2_bins(stack.enter_context(tempfile.TemporaryDirectory(prefix="fp8engine-bench-")))
        print(env_info() | {"processes": args.layout.world_size, "data": args.data or "the command's default bytes"},
              flush=True)
        try:
            if args.guard_cost:
                return _main_guard_cost(models, modes, args)
            return _main_table(models, modes, args)
        except UsageError as err:
            parser.error(str(err))
        finally:
            if args.layout.world_size > 1:
                import torch.distributed as dist

                dist.destroy_process_group()


def _main_table(models: list[str], modes: list[str], args: argparse.Namespace) -> int:
    base = {}
    json_path = args.json if args.layout.is_main else None

    def report(row: dict) -> None:
        if row["mode"] == args.baseline:
            base[row["model"]] = row["tokens_per_s"]
        row["vs_base"] = row["tokens_per_s"] / base[row["model"]] if row["model"] in base else float("nan")
        print(f"  {row['model']} {row['layout']} {row['mode']}: {row['step_ms']:.1f} ms/step, "
              f"{row['tokens_per_s_per_gpu']:.0f} tok/s per GPU, peak {row.get('peak_mem_gib', 0.0):.1f} GiB (set-up "
              f"{row.get('setup_s', 0.0):.0f} s, steps {row.get('steps_s', 0.0):.0f} s)", flush=True)

    rows, failed = _rows(models, modes, _run_mode, report, args, save=lambda done: write_json(json_path, "train", done))
    print(f"vs_base: tokens/s over mode {args.baseline}'s (same model, same layout)")
    print_table(rows, ["model", "layout", "mode", "batch", "vocab", "step_ms", "tokens_per_s", "tokens_per_s_per_gpu",
                       "vs_base", "model_tflops", "mfu", "peak_mem_gib", "graphed", "guard", "loss_first", "loss_last",
                       "error"])
    write_json(json_path, "train", rows)
    return 1 if failed else 0


def _rows(models: list[str], modes: list[str], run_one, report, args: argparse.Namespace,
          save=None) -> tuple[list, bool]:
    """``run_one(model, mode, args) -> row`` for every model and mode, ``report(row)`` after each; a mode that raises
    gets an ``error`` row instead (one failing mode must not hide the others' rows). ``save(rows)`` after each mode
    (the JSON so far: a run stopped by a time limit keeps the modes it finished). Returns ``(rows, failed)``."""
    rows, failed = [], False
    world = args.layout.world_size if getattr(args, "layout", None) is not None else 1
    for model_name in models:
        for mode in modes:
            try:
                row = run_one(model_name, mode, args)
            except Exception as err:  # the status says it failed
                line = f"  {model_name} {mode}: FAILED: {type(err).__name__}: {err}"
                if world > 1:
                    # every rank's failure on stderr (only rank 0's stdout is shown), then out: the other ranks
                    # wait in this mode's collectives, and a rank going on to the next mode would hang them all;
                    # torchrun stops them when this process exits (the JSON keeps the modes finished before)
                    print(f"[rank {args.layout.rank}]{line}", file=sys.stderr, flush=True)
                    raise
                print(line, flush=True)
                rows.append({"model": model_name, "mode": mode, "error": f"{type(err).__name__}: {err}"[:200]})
                failed = True
                _release()
            else:
                report(row)
                rows.append(row)
            if save is not None:
                save(rows)
    return rows, failed


def _main_guard_cost(models: list[str], modes: list[str], args: argparse.Namespace) -> int:
    def report(row: dict) -> None:
        print(f"  {row['model']} {row['mode']}: {row['guard_ms']:.2f} ms/step with the guard, {row['no_guard_ms']:.2f} "
              f"without ({row['guard_cost_pct']:+.2f} %)", flush=True)

    rows, failed = _rows(models, modes, _guard_cost, report, args,
                         save=lambda done: write_json(args.json, "train-guard-cost", done))
    print_table(rows, ["model", "mode", "batch", "guard_ms", "no_guard_ms", "guard_cost_pct", "steps_each", "error"])
    write_json(args.json, "train-guard-cost", rows)
    return 1 if failed else 0
