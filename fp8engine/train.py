"""``python -m fp8engine.train``: train a GPT with FP8 GEMMs (or bf16/fp32) and show it learning.

With no options it trains the ``tiny`` model on the bytes of this Python's standard library sources (read at run
time) in FP8 (emulated by ``torch._scaled_mm`` on a CPU), in a few minutes on two cores: a progress bar with
loss, tokens/s and learning rate, validation on the held-out last 10 %, and a generated sample at the end.

Precision and parameter dtype:
- ``fp32``: fp32 parameters and activations.
- ``bf16``: fp32 parameters (the optimizer's master weights), forward under ``torch.autocast(bfloat16)``.
- ``fp8``: fp32 parameters; the TransformerLayers' GEMMs run in FP8 inside :func:`fp8engine.autocast`; on CUDA
  the rest of the forward also runs under ``torch.autocast(bfloat16)``, on the CPU it stays fp32. Embedding, LM
  head and loss never run in FP8. ``--recipe``: ``delayed`` (per-tensor, amax history), ``current`` (per-tensor,
  just in time) or ``block`` (:class:`~fp8engine.recipe.Float8BlockScaling`: 1 x 128 / 128 x 128 block scales,
  just in time; the model's per-rank dims must be multiples of 128, e.g. the default ``tiny`` model).

Keeping fp32 parameters costs memory but keeps AdamW's small updates exact, and FP8 casts the weights from them
at every step anyway (TransformerEngine's recipe keeps fp32 master weights too).

Determinism: the batch of step ``t`` is a pure function of ``(--seed, t)`` (:mod:`fp8engine.training.data`) and
checkpoints hold every RNG state and the FP8 scaling buffers, so on the CPU a run stopped at step ``k``
(``--stop-at k``, or Ctrl-C, which checkpoints the last finished step) and continued with ``--resume`` logs
exactly the losses of an uninterrupted run.

Bad input exits with status 2 and one line saying what to change, before anything is written to ``--out``.

Failures: a step whose loss or global gradient norm is NaN/inf changes nothing (weights, AdamW state, FP8
scaling buffers; :mod:`fp8engine.training.guard`, checked on the device and read with the loss); the run then
stops with one line naming the step and exit status 3, or with ``--skip-nonfinite N`` goes on, stopping after N
skipped steps in a row. A checkpoint is never written from non-finite weights. The last ``--keep-checkpoints``
checkpoints are kept with CRC-32 sidecars (multi-process runs: the last K step folders with checksums);
``--resume`` reports a damaged one in one line and falls back to the newest that loads (in a multi-process run,
the newest every process verifies, each saying so in the same line). In a multi-process run a failed or
timed-out collective (another rank died; ``--dist-timeout``) ends every surviving process with one line and exit
status 1.

FP8 health (``--fp8-stats N``): every N-th step counts, for every FP8 tensor role, amax, scale, underflow % and
saturation % (:mod:`fp8engine.fp8.stats`, on the device), stores the rows in that step's ``metrics.jsonl`` object
(:mod:`fp8engine.training.fp8_health`) and redraws ``fp8_health.png`` at every checkpoint and at the end. With the
CUDA graph on, those steps run eagerly outside the graph (the counting switches are host-side, which a replay does
not see); the other steps replay it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

import fp8engine
from fp8engine.fp8.autocast import FP8Context, get_fp8_context, recompute_context
from fp8engine.fp8.state import ScalingState
from fp8engine.models import GPT, GPT_CONFIGS, GPTConfig
from fp8engine.parallel import RNGStatesTracker, all_reduce_sequence_parallel_grads, model_parallel_manual_seed
from fp8engine.parallel.data_parallel import GradientAverager, broadcast_parameters
from fp8engine.parallel.fsdp import local_tensor, shard_model
from fp8engine.training import UsageError
from fp8engine.training.checkpoint import (CHECKPOINT_NAME, atomic_write, capture_rng_state, checkpoint_paths,
                                           load_checkpoint, restore_rng_state, save_checkpoint)
from fp8engine.training.guard import NonFiniteGuard
from fp8engine.training.distributed import (Layout, all_reduce_sum, all_reduce_sum_, check_layout, clip_grad_norm,
                                            env_world_size, init_layout, wait_for_all)
from fp8engine.training.sharded_checkpoint import (SHARDED_DIR, CheckpointNotWritten, has_sharded, load_sharded,
                                                   read_sharded_settings, reshardable, save_sharded, select_sharded)
from fp8engine.training.data import TokenData, batch_seed, check_seq_len, get_batch, load_data
from fp8engine.training.step import CUDAGraphStep, TrainStep, capture_problem, graph_warmup, make_optimizer, set_lr
from fp8engine.training.metrics import PLOT_NAME, MetricsLog, plot_losses, read_metrics
from fp8engine.training.flags import (RECIPES, check_block_run, check_fp8_dims, check_lm_loss, check_out,
                                     check_precision, fill_defaults, resolve_device)
from fp8engine.training import flags
from fp8engine.training.fp8_health import HEALTH_PLOT_NAME, STATS_KEY, plot_fp8_health, rows_to_json
from fp8engine.fp8.stats import fp8_stats, fp8_stats_recording
from fp8engine._cpu import FLUSH_DENORMAL_ENV, denormals_flushed, flush_denormals, prefer_avx2_cpu_kernels

__all__ = ["main", "build_parser", "lr_at"]

def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser (:func:`fp8engine.training.flags.build_parser`)."""
    return flags.build_parser(description=__doc__.split("\n\n")[0])


#: Options that define a run; ``--resume`` refuses to continue a checkpoint written with different values.
_RUN_IDENTITY = ("model", "precision", "recipe", "batch_size", "seq_len", "lr", "dropout", "grad_accum", "seed",
                 "weight_decay", "warmup_steps", "data", "n_layer", "n_head", "hidden_size", "ffn_hidden_size", "tp",
                 "sequence_parallel", "world_size", "fp8_lm_head")
#: Identity keys added later: their value in a checkpoint written before them.
_IDENTITY_DEFAULTS = {"fp8_lm_head": False}
_SAMPLE_TEMPERATURE, _SAMPLE_TOP_K = 0.8, 40
def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Learning rate of 1-based ``step``: linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to
    ``min_ratio * peak`` at ``total`` (nanoGPT's schedule)."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _model_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    base = GPT_CONFIGS[args.model]
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "hidden_size", "ffn_hidden_size")
                 if getattr(args, k) is not None}
    overrides.update(vocab_size=vocab_size, max_seq_len=base.max_seq_len if args.seq_len is None else args.seq_len,
                     lm_loss=args.lm_loss, fp8_lm_head=args.fp8_lm_head)
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    try:
        config = GPTConfig.from_name(args.model, **overrides)
    except ValueError as err:
        raise UsageError(f"--model {args.model} with these sizes is invalid: {err}") from None
    if args.precision == "fp8":
        check_fp8_dims(args, config, tp_size=1)
    return config


@dataclass
class Run:
    """Everything a training run needs, validated."""

    args: argparse.Namespace
    device: torch.device
    data: TokenData
    config: GPTConfig
    out: Optional[Path]
    checkpoint: Optional[dict[str, Any]]
    layout: Layout = dataclasses.field(default_factory=Layout)
    #: With --tp > 1: the RNG tracker whose per-tp-rank state drives dropout inside tensor-parallel regions.
    rng_tracker: Any = None
    #: Why the step is not captured in a CUDA graph (one line), or None when it is.
    graph_problem: Optional[str] = None
    #: With data-parallel replicas: the gradient averager whose all-reduces the step runs (and captures).
    grad_averager: Any = None


def prepare(args: argparse.Namespace) -> Run:
    """Validate every input before anything is written (raises :class:`UsageError`)."""
    args = fill_defaults(args)
    device = resolve_device(args.device)
    check_precision(args, device)
    check_lm_loss(args, device)
    data = load_data(args.data)
    config = _model_config(args, data.vocab_size)
    args.seq_len = config.max_seq_len
    check_seq_len(data, args.seq_len)
    check_layout(args.tp, args.sequence_parallel, config, args.seq_len, args.precision == "fp8")
    if args.fsdp and env_world_size() // args.tp < 2:
        raise UsageError(f"--fsdp shards over data-parallel processes: launch with torchrun and at least 2 "
                         f"processes per --tp group (world size {env_world_size()} / --tp {args.tp} < 2), or drop "
                         "--fsdp")
    fsdp_only = [flag for flag, given in (("--fp8-all-gather", args.fp8_all_gather),
                                          ("--no-fsdp-reshard-after-forward", not args.fsdp_reshard_after_forward),
                                          ("--fsdp-reduce-dtype bf16", args.fsdp_reduce_dtype != "fp32"),
                                          ("--fsdp-layers-per-group", args.fsdp_layers_per_group is not None))
                 if given]
    if fsdp_only and not args.fsdp:
        raise UsageError(f"{', '.join(fsdp_only)} only apply with --fsdp; add --fsdp or drop them")
    if args.precision == "fp8" and args.recipe == "block":
        check_block_run(args, config)
    if args.out is not None and not args.out.strip():
        raise UsageError("--out must name a directory; got an empty string")
    out = Path(args.out) if args.out else None
    checkpoint = None
    if out is not None:
        check_out(out)
    if args.resume:
        checkpoint = (read_sharded_settings(out, _settings(args)) if has_sharded(out)
                      else load_checkpoint(out))
        _check_same_run(checkpoint["settings"], args)
        if checkpoint["step"] >= args.steps:
            raise UsageError(f"--resume: the checkpoint is already at step {checkpoint['step']}; pass "
                             f"--steps larger than that to train further")
    elif out is not None and (any(p.exists() for p in checkpoint_paths(out)) or has_sharded(out)):
        raise UsageError(f"--out {out} already holds a checkpoint; pass --resume to continue it or choose "
                         "another --out")
    if out is not None:  # last: every other input is valid, so creating the directory is the run's first write
        _create_out(out)
    return Run(args, device, data, config, out, checkpoint)


def _create_out(out: Path) -> None:
    """Create ``out`` (and its parents; no error when it exists). Raise :class:`UsageError` when the file system
    refuses (permission bits checked by :func:`check_out` do not cover read-only mounts, ``/proc``, quotas)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out} cannot be created: {err.strerror or err}; choose another directory") from None


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _RUN_IDENTITY} | {"steps": args.steps, "fsdp": args.fsdp}


def _check_same_run(saved: dict[str, Any], args: argparse.Namespace) -> None:
    for key in _RUN_IDENTITY:
        if key == "world_size" and reshardable(saved, _settings(args)):
            continue  # FSDP2 checkpoints reshard onto another number of processes (load_sharded)
        want = saved.get(key, _IDENTITY_DEFAULTS.get(key))
        if want != getattr(args, key):
            flag = "--" + key.replace("_", "-")
            fix = f"{'add' if want else 'drop'} {flag}" if isinstance(want, bool) else f"pass {flag} {want}"
            raise UsageError(f"--resume: the checkpoint was written with {flag} {want}, this run has "
                             f"{getattr(args, key)}; {fix} or use a new --out")


def _precision_context(args: argparse.Namespace, device: torch.device, train: bool, amax_group=None):
    """Context for one forward: torch.autocast(bf16) where it applies, plus the FP8 region.

    Training forwards use ``fp8engine.autocast`` (delayed scaling updates its scales at exit). Evaluation and
    sampling use the current scales without recording amaxes or updating them, so they do not change the run.
    """
    stack = contextlib.ExitStack()
    if args.precision == "bf16" or (args.precision == "fp8" and device.type == "cuda"):
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    if args.precision == "fp8":
        recipe = RECIPES[args.recipe]()
        stack.enter_context(fp8engine.fp8_autocast(True, recipe, fp8_group=amax_group) if train
                            else recompute_context(FP8Context(recipe, amax_group)))
    return stack


def _build(run: Run) -> tuple[GPT, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(run.args.seed)  # same on every rank: tp shards are slices of the same unsharded init
    layout = run.layout
    if layout.tp_size > 1:  # Megatron's seeds: default generator = seed, model-parallel state = seed + 2718 + tp rank
        run.rng_tracker = model_parallel_manual_seed(run.args.seed, layout.tp_rank, RNGStatesTracker(run.device),
                                                     device=run.device)
    model = GPT(run.config, tp_group=layout.tp_group, sequence_parallel=run.args.sequence_parallel,
                device=run.device, rng_tracker=run.rng_tracker)
    if not run.args.fused_layer:
        for layer in model.layers:
            layer.fused = False
    if run.args.fsdp:  # before the optimizer: it holds the DTensor shards; bf16 all-gathers where autocast is on
        param_dtype = torch.bfloat16 if run.device.type == "cuda" and run.args.precision != "fp32" else None
        fp8_gather = (run.args.fp8_all_gather and run.args.precision == "fp8"
                      and run.args.recipe in ("delayed", "current"))
        reduce_dtype = torch.bfloat16 if run.args.fsdp_reduce_dtype == "bf16" else torch.float32
        shard_model(model, layout.dp_mesh, model.layers, param_dtype=param_dtype, fp8_all_gather=fp8_gather,
                    reduce_dtype=reduce_dtype, reshard_after_forward=run.args.fsdp_reshard_after_forward,
                    layers_per_group=run.args.fsdp_layers_per_group or flags.FSDP_LAYERS_PER_GROUP)
    optimizer = make_optimizer(model, run.args.lr, run.args.weight_decay, run.device)
    if run.checkpoint is not None and layout.world_size > 1:
        saved_world = run.checkpoint["settings"]["world_size"]
        if saved_world != layout.world_size and layout.is_main:
            print(f"fp8engine.train: resuming {run.checkpoint['dir']} of {saved_world} processes on "
                  f"{layout.world_size}: DCP reshards the FSDP2 parameters and AdamW state; the FP8 scaling state is "
                  "the MAX over the saved ranks', the RNG states start anew and each step draws "
                  f"{layout.dp_size} x --batch-size sequences: the run continues, not an exact resume",
                  file=sys.stderr, flush=True)
        run.checkpoint.update(load_sharded(run.checkpoint["dir"], layout, model, optimizer, run.rng_tracker,
                                           saved_world))  # adds "rng" (None when resharded)
    elif run.checkpoint is not None:
        model.load_state_dict(run.checkpoint["model"])
        optimizer.load_state_dict(run.checkpoint["optimizer"])
    step_model = model
    if layout.dp_size > 1 and not run.args.fsdp:
        # Replicas start from the dp group's first rank's weights, as DDP makes them; the gradients are averaged by
        # run.grad_averager's all-reduces (launched during the backward, captured with the step in a CUDA graph).
        # Buffers are not broadcast: the FP8 amax histories hold each rank's own amaxes until the next autocast
        # exit reduces them over the dp group (and a resumed rank's come from its own checkpoint shard).
        broadcast_parameters(model, layout.dp_group)
        run.grad_averager = GradientAverager(model.parameters(), layout.dp_group, bucket_mb=100.0)
    if run.args.compile and run.args.fsdp:
        # Each layer's forward compiled on its own (torchtitan's per-block compile): FSDP2's hooks, which Dynamo
        # does not trace, run between the layers. Compiling the whole model puts them inside the loop over the
        # layers, and a graph break inside a loop makes Dynamo skip the whole GPT.forward frame. The layer's scaling
        # states are registered with the FP8 region by an eager pre-hook, not by the traced code, whose per-state
        # registry keys would make Dynamo guard on each layer's states and recompile every layer (past its
        # recompile_limit of 8, the remaining layers would run eagerly). The command's GPT checkpoints no activations,
        # so no recompute needs the traced registration.
        for layer in model.layers:
            states = [m for m in layer.modules() if isinstance(m, ScalingState)]
            for state in states:
                state.registered_outside_graph = True
            layer.register_forward_pre_hook(functools.partial(_register_states, states))
            layer.forward = torch.compile(layer.forward)
    elif run.args.compile:
        step_model = torch.compile(step_model)
    return model, step_model, optimizer


def _register_states(states: list, module: torch.nn.Module, args: tuple) -> None:
    """Forward pre-hook of a layer compiled on its own: register its scaling states with the active delayed-scaling
    FP8 region, eagerly (what the traced code would do, without a guard per layer)."""
    ctx = get_fp8_context()
    if ctx is not None and isinstance(ctx.recipe, fp8engine.DelayedScaling):
        for state in states:
            ctx.register(state)


def graph_problem(run: Run) -> Optional[str]:
    """Why this run's step is not captured in a CUDA graph (one line), or None: :func:`capture_problem`'s reasons,
    and the options whose work a graph cannot hold (liger/cce losses read values on the host; FSDP2 manages its
    memory from the host)."""
    args = run.args
    problem = capture_problem(run.device, args.compile)
    if problem is None and args.lm_loss in ("liger", "cce"):
        problem = (f"CUDA graphs are not used with --lm-loss {args.lm_loss} (its loss reads values on the host; "
                   "--lm-loss chunked is captured)")
    if problem is None and args.fsdp:
        problem = "CUDA graphs are not used with --fsdp (FSDP2 schedules its all-gathers and frees their memory " \
                  "from the host)"
    return problem


def make_step(run: Run, model: GPT, step_model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              guard: bool = True) -> TrainStep:
    """The step object of this run: captured in a CUDA graph where :func:`capture_problem` allows it and
    ``--no-cuda-graphs`` is not given, else eager; with a :class:`NonFiniteGuard` of ``model`` unless ``guard``
    is False (``bench train --no-guard``)."""
    args, layout = run.args, run.layout

    def context():
        return _precision_context(args, run.device, train=True, amax_group=layout.dp_group)

    fsdp_group = layout.dp_group if args.fsdp else None

    def clip(params):
        return clip_grad_norm(params, 1.0, layout.tp_group, fsdp_group)

    after_backward = None
    if args.sequence_parallel:
        def after_backward():
            all_reduce_sequence_parallel_grads(model, layout.tp_group)
    params = list(model.parameters())
    nf_guard = NonFiniteGuard(model, group=layout.dp_group) if guard else None
    if args.cuda_graphs and run.graph_problem is None:
        return CUDAGraphStep(step_model, params, optimizer, context, args.grad_accum, clip, after_backward,
                             device=run.device, guard=nf_guard, grad_averager=run.grad_averager,
                             warmup=graph_warmup(args.compile),
                             graph_generators=run.rng_tracker.graph_states() if run.rng_tracker else ())
    return TrainStep(step_model, params, optimizer, context, args.grad_accum, clip, after_backward,
                     device=run.device, guard=nf_guard, grad_averager=run.grad_averager)


def step_batches(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``step`` for this data-parallel rank: ``[grad_accum, b, s]`` int64 each (CPU; in
    pinned memory for a CUDA run, so the step's copy to the device does not wait for the steps queued before)."""
    args, layout = run.args, run.layout
    pairs = [get_batch(run.data.train, args.batch_size, args.seq_len,
                       batch_seed(args.seed, "train", step, micro * layout.dp_size + layout.dp_rank))
             for micro in range(args.grad_accum)]
    xs, ys = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    if run.device.type == "cuda":
        xs, ys = xs.pin_memory(), ys.pin_memory()
    return xs, ys


@torch.no_grad()
def evaluate(run: Run, model: torch.nn.Module) -> float:
    """Mean loss over ``--eval-iters`` fixed validation batches (the same batches at every evaluation; dp
    replicas split them). Under ``--fsdp`` every forward is collective (its all-gathers), so every rank runs the
    same number of forwards: a rank past the last batch repeats one and leaves it out of the mean."""
    args, layout = run.args, run.layout
    model.eval()
    total, count = 0.0, 0
    forwards = -(-args.eval_iters // layout.dp_size) if args.fsdp else None
    batches = (range(layout.dp_rank, forwards * layout.dp_size, layout.dp_size) if args.fsdp
               else range(layout.dp_rank, args.eval_iters, layout.dp_size))
    for i in batches:
        x, y = get_batch(run.data.val, args.batch_size, args.seq_len,
                         batch_seed(args.seed, "val", i % args.eval_iters, 0))
        with _precision_context(args, run.device, train=False):
            loss = model(x.to(run.device), y.to(run.device)).item()
        if i < args.eval_iters:
            total += loss
            count += 1
    model.train()
    total, count = all_reduce_sum([total, count], layout.dp_group, run.device)
    return total / count


def _save(run: Run, model: GPT, optimizer: torch.optim.Optimizer, step: int) -> None:
    if run.out is None:
        return
    bad = sum(int(not torch.isfinite(local_tensor(t)).all()) for t in model.state_dict().values()
              if t.is_floating_point())
    if run.layout.world_size > 1:  # every rank decides alike (a tp shard may be the only non-finite one)
        import torch.distributed as dist

        flag = torch.tensor([bad], dtype=torch.float64, device=run.device)
        dist.all_reduce(flag)
        bad = int(flag.item())
    if bad:
        raise NonFiniteStop(f"step {step}: the weights are not finite; no checkpoint written (the last one in "
                            f"{run.out} is kept)")
    state = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        "data_position": {"next_step": step + 1, "sampler": "batch_seed(seed, split, step, micro)"},
        "rng": capture_rng_state(run.rng_tracker), "settings": _settings(run.args), "config": dataclasses.asdict(run.config)}
    if run.layout.world_size > 1:
        save_sharded(run.out, run.layout, model, optimizer, state, step, keep=run.args.keep_checkpoints,
                     device=run.device)
    else:
        save_checkpoint(run.out, state, keep=run.args.keep_checkpoints)


class NonFiniteStop(Exception):
    """The run stops on a non-finite loss or gradient norm (message: one line naming the step)."""


class _GracefulStop:
    """First Ctrl-C (SIGINT) asks the loop to stop after the current step, checkpointed; a second one aborts."""

    def __init__(self, enabled: bool = True):
        self.requested, self.enabled = False, enabled
        self._previous = None

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def train(run: Run, model: GPT, step_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The training loop; returns the last finished step (checkpointed when ``--out`` is given)."""
    args = run.args
    step_fn = make_step(run, model, step_model, optimizer)
    start = 0 if run.checkpoint is None else run.checkpoint["step"]
    if run.checkpoint is not None and run.checkpoint["rng"] is not None:
        restore_rng_state(run.checkpoint["rng"], run.rng_tracker)
    end = args.stop_at or args.steps
    main_rank = run.layout.is_main
    log = MetricsLog(run.out if main_rank else None, resume_step=start if run.checkpoint is not None else None)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * run.layout.dp_size
    bar = tqdm(total=end, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=not main_rank)
    step, skipped = start, 0
    saved = start if run.checkpoint is not None else None  # step of the newest checkpoint in --out

    def handle(record: dict[str, Any], ahead: bool) -> bool:
        """Log one finished step's record; returns True when the loop must end. ``ahead``: the next step is already
        queued on the device (never a step that evaluates, checkpoints or stops: those are read at once)."""
        nonlocal skipped, saved
        step = record["step"]
        if record.pop("found_inf"):
            skipped += 1
            what = (f"non-finite loss ({record['loss']})" if not math.isfinite(record["loss"]) else
                    f"non-finite gradient norm (loss {record['loss']:.4g})")
            what += f" at step {step}; the step was not applied"
            if skipped > args.skip_nonfinite:
                hint = (f"{skipped} in a row, --skip-nonfinite {args.skip_nonfinite}" if args.skip_nonfinite
                        else "pass --skip-nonfinite N to skip such steps, or lower --lr")
                raise NonFiniteStop(f"{what}; stopping ({hint}){_kept_checkpoint(run, saved)}")
            if main_rank:
                bar.write(f"skipped: {what} ({skipped} in a row, at most {args.skip_nonfinite})")
            record["skipped"] = True
        else:
            skipped = 0
        if step % args.eval_interval == 0 or step == args.steps:
            record["val_loss"] = evaluate(run, model)
            if main_rank:
                bar.write(f"step {step}: train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f}")
        log.log(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                        lr=f"{record['lr']:.2e}")
        bar.update(1)
        if ahead:
            return False
        if "val_loss" in record or step == end or stop.requested:
            _save(run, model, optimizer, step)
            saved = step if run.out is not None else None
            _plot_health(run)
        if stop.requested:
            bar.write(f"stopped at step {step}" + (f"; continue with --resume --out {run.out}"
                                                   if run.out else ""))
            return True
        return False

    # Multi-rank runs keep Ctrl-C's default (ranks could stop at different steps and hang a collective).
    with _GracefulStop(enabled=run.layout.world_size == 1) as stop:
        try:
            pending, last = None, time.perf_counter()
            for step in range(start + 1, end + 1):
                # On CUDA the loss of step N is read once step N + 1 is queued (one step behind), so the GPU does
                # not wait for the host between steps; a step that evaluates, checkpoints, records FP8 stats or
                # stops is read at once, before the next step changes the weights (and on the CPU every step).
                launched = launch_step(run, step_fn, optimizer, step, model)
                if pending is not None:
                    record, last = finish_step(run, pending, tokens_per_step, last)
                    handle(record, ahead=True)
                    pending = None
                if (launched.ready is not None and not launched.stats and not stop.requested and step != end
                        and step % args.eval_interval and step != args.steps):
                    pending = launched
                    continue
                record, _ = finish_step(run, launched, tokens_per_step, last)
                if handle(record, ahead=False):
                    break
                last = time.perf_counter()  # (the next step's time starts after this one's evaluation, checkpoint)
        finally:
            bar.close()
            log.close()
    return step


def _kept_checkpoint(run: Run, saved: Optional[int]) -> str:
    """The end of a non-finite stop's line: which checkpoint ``--out`` keeps (``saved``: its step, or None)."""
    if run.out is None:
        return ""
    if saved is None:
        return (f"; no checkpoint was written yet (they are written every --eval-interval {run.args.eval_interval} "
                "steps)")
    return f"; the checkpoint of step {saved} in {run.out} is kept"


@dataclass
class LaunchedStep:
    """A training step queued on the device (:func:`launch_step`) whose loss the host has not read yet."""

    step: int
    lr: float
    values: torch.Tensor  # [loss, found_inf] summed over data-parallel ranks, on the host once ``ready`` is done
    ready: Optional[torch.cuda.Event]  # recorded after the copy of ``values`` to the host (None: a CPU step)
    stats: bool  # an --fp8-stats step (its stats are read with the loss)
    model: Optional[GPT]


def launch_step(run: Run, step_fn: TrainStep, optimizer: torch.optim.Optimizer, step: int,
                model: Optional[GPT] = None) -> LaunchedStep:
    """Queue optimizer step ``step`` (learning rate, batch, the step itself, the data-parallel sum of its loss and
    ``found_inf``, and their copy to pinned host memory) without waiting for the device. On ``--fp8-stats`` steps
    (``model`` given) the step runs eagerly with FP8 stats recording. :func:`finish_step` reads it."""
    args, layout = run.args, run.layout
    lr = lr_at(step, args.lr, args.warmup_steps, args.steps)
    set_lr(optimizer, lr)
    xs, ys = step_batches(run, step)
    stats_step = model is not None and args.fp8_stats > 0 and step % args.fp8_stats == 0
    with fp8_stats_recording(model, enabled=stats_step):
        loss_t = step_fn(xs, ys, eager=stats_step)
    found = step_fn.found_inf  # (one transfer for both: the flag rides with the loss the host reads anyway)
    values = torch.stack([loss_t.detach().double(), torch.zeros((), dtype=torch.float64, device=loss_t.device)
                          if found is None else found.double()])
    if layout.dp_group is not None:
        all_reduce_sum_(values, layout.dp_group)
    ready = None
    if values.is_cuda:
        host = torch.empty(2, dtype=torch.float64, pin_memory=True)
        host.copy_(values, non_blocking=True)
        values, ready = host, torch.cuda.Event()
        ready.record()
    return LaunchedStep(step, lr, values, ready, stats_step, model if stats_step else None)


def finish_step(run: Run, launched: LaunchedStep, tokens_per_step: int, since: float
                ) -> tuple[dict[str, Any], float]:
    """Wait for a :func:`launch_step` step's loss and return ``(record, now)``: the record of ``metrics.jsonl``
    (``tokens_per_s`` over the time since ``since``, the previous step's finish: one step of a steady loop) and
    the time it was read. On ``--fp8-stats`` steps the record gets the model's stats rows (one more read)."""
    if launched.ready is not None:
        launched.ready.synchronize()
    loss, bad = launched.values.tolist()
    now = time.perf_counter()
    record = {"step": launched.step, "loss": loss / run.layout.dp_size, "lr": launched.lr, "found_inf": bad > 0,
              "tokens_per_s": tokens_per_step / (now - since)}
    if launched.stats and run.layout.is_main:  # rank 0's casts (rank 0 writes metrics.jsonl)
        record[STATS_KEY] = rows_to_json(fp8_stats(launched.model))
    return record, now


def _plot_health(run: Run, records: Optional[list[dict[str, Any]]] = None) -> None:
    """Redraw ``fp8_health.png`` from ``metrics.jsonl`` (or its ``records`` read already; main rank,
    ``--fp8-stats`` runs with ``--out``)."""
    if run.out is None or not run.args.fp8_stats or not run.layout.is_main:
        return
    a = run.args
    records = read_metrics(run.out / "metrics.jsonl") if records is None else records
    plot_fp8_health(records, run.out / HEALTH_PLOT_NAME,
                    title=f"FP8 health: {a.model} GPT, {a.recipe} scaling, every {a.fp8_stats} steps")


def sample(run: Run, model: GPT, num_tokens: int) -> str:
    """Generate ``num_tokens`` after a newline (or the first validation token), decoded when the vocabulary is
    known, else as token ids. Deterministic for a given ``--seed``."""
    data = run.data
    prompt = (data.encode("\n") if data.encode is not None else []) or [int(data.val[0])]
    tokens = torch.tensor([prompt], dtype=torch.long, device=run.device)
    gen = torch.Generator(device=run.device).manual_seed(run.args.seed)
    with _precision_context(run.args, run.device, train=False):
        out = model.generate(tokens, num_tokens, temperature=_SAMPLE_TEMPERATURE, top_k=_SAMPLE_TOP_K,
                             generator=gen)
    new = out[0, len(prompt):].tolist()
    return data.decode(new) if data.decode is not None else " ".join(map(str, new))


def _write_run_files(run: Run) -> None:
    run.out.mkdir(parents=True, exist_ok=True)
    config = {"settings": _settings(run.args), "model": dataclasses.asdict(run.config),
              "data": run.data.description, "device": str(run.device), "torch": torch.__version__}
    atomic_write(run.out / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def _describe(run: Run, model: GPT) -> str:
    a = run.args
    fp8 = f" ({a.recipe} scaling)" if a.precision == "fp8" else ""
    par = f", dp {run.layout.dp_size} x tp {run.layout.tp_size}" if run.layout.world_size > 1 else ""
    if run.device.type != "cuda":
        device_line = (f"\n  CPU denormals: {'flushed to zero' if denormals_flushed() else 'kept'} "
                       f"({FLUSH_DENORMAL_ENV}=0: kept)")
    elif a.cuda_graphs and run.graph_problem is None:
        device_line = (f"\n  CUDA graphs: the training step{' (compiled)' if a.compile else ''} is captured "
                       f"after {graph_warmup(a.compile)} eager steps and replayed (--no-cuda-graphs: off)")
    else:
        device_line = f"\n  CUDA graphs: off ({'--no-cuda-graphs' if not a.cuda_graphs else run.graph_problem})"
    stats = ""
    if a.fp8_stats:
        stats = (f"\n  FP8 stats: every {a.fp8_stats} steps into metrics.jsonl" + (" and fp8_health.png" if run.out
                                                                                   else " (no --out: not kept)"))
        if run.device.type == "cuda" and a.cuda_graphs and run.graph_problem is None:
            stats += "; those steps run eagerly, outside the CUDA graph (a replay cannot switch the counting on)"
    return (f"fp8engine.train: {a.model} GPT, {model.num_params():,} parameters{' per rank' if par else ''}, "
            f"{a.precision}{fp8} on {run.device}{par}\n  data: {run.data.description}; {len(run.data.train):,} train / "
            f"{len(run.data.val):,} val tokens\n  {a.steps} steps x {a.grad_accum} x {a.batch_size} x "
            f"{a.seq_len} tokens, AdamW lr {a.lr:g} (warm-up {a.warmup_steps}, cosine){device_line}{stats}")


def _finish(run: Run, model: GPT, last_step: int) -> None:
    sample_now = last_step == run.args.steps and run.args.sample_tokens > 0 and run.layout.tp_size == 1
    if run.args.fsdp and sample_now:  # every rank generates (each forward all-gathers); rank 0 prints
        try:
            text = sample(run, model, run.args.sample_tokens)
        except ValueError as err:
            text = err
    if not run.layout.is_main:
        return
    records = read_metrics(run.out / "metrics.jsonl") if run.out else []
    if run.out is not None and records:
        plot_losses(records, run.out / PLOT_NAME, title=f"{run.args.model} GPT, {run.args.precision}")
    _plot_health(run, records)
    if sample_now:
        try:
            if not run.args.fsdp:
                text = sample(run, model, run.args.sample_tokens)
            if isinstance(text, ValueError):
                raise text
            print(f"--- sample (temperature {_SAMPLE_TEMPERATURE}, top-k {_SAMPLE_TOP_K}) ---\n{text}\n---")
        except ValueError as err:  # non-finite logits (e.g. steps skipped with --skip-nonfinite): no sample
            print(f"no sample: {err}")
    if run.out is not None:
        ckpt = run.out / (CHECKPOINT_NAME if run.layout.world_size == 1 else SHARDED_DIR)
        health = f", {run.out / HEALTH_PLOT_NAME}" if run.args.fp8_stats else ""
        print(f"wrote {run.out / 'metrics.jsonl'}, {ckpt}, {run.out / PLOT_NAME}{health}")


def _select_sharded(run: Run) -> dict[str, Any]:
    """Multi-rank ``--resume``: the newest checkpoint folder every rank verifies (collective; each skipped one is
    reported by every rank in the same line). Raises :class:`UsageError` when none does."""
    meta = select_sharded(run.out, _settings(run.args), run.device,
                          report=lambda line: print(f"fp8engine.train: {line}", file=sys.stderr, flush=True))
    _check_same_run(meta["settings"], run.args)
    return meta


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m fp8engine.train`` / ``fp8engine-train``; returns the exit status.

    Runs with torch's AVX2 CPU kernels and with denormal floats flushed to zero on the CPU, unless the user set
    ``ATEN_CPU_CAPABILITY`` / ``FP8ENGINE_FLUSH_DENORMAL=0`` (:mod:`fp8engine._cpu`; the flush is undone on return)."""
    prefer_avx2_cpu_kernels()  # before the first CPU kernel (fp8engine/_cpu.py)
    with flush_denormals():  # before torch starts its thread pool, which inherits the setting
        return _main(argv)


def _main(argv: Optional[list[str]]) -> int:
    args = build_parser().parse_args(argv)
    try:
        run = prepare(args)
    except UsageError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"fp8engine.train: error: {err}", file=sys.stderr, flush=True)
        else:  # every rank found the same error (before a process group exists) and rank 0 says it; torchrun stops
            # the other ranks at the first exit, so they wait for rank 0's exit instead of racing it (a fixed 2 s
            # lost that race on a loaded host: no error line); bounded for launchers that do not stop them
            time.sleep(60.0)
        return 2
    warning = flags.seq_len_warning(args)
    if warning and int(os.environ.get("RANK", "0")) == 0:
        print(f"fp8engine.train: warning: {warning}", file=sys.stderr, flush=True)
    run.layout = init_layout(args.tp, run.device, timeout=args.dist_timeout)
    if run.device.type == "cuda":
        run.device = torch.device("cuda", torch.cuda.current_device())
    run.graph_problem = graph_problem(run)
    try:
        if run.checkpoint is not None and run.layout.world_size > 1:
            run.checkpoint = _select_sharded(run)
        if run.out is not None and run.checkpoint is None and run.layout.is_main:
            _write_run_files(run)
        model, step_model, optimizer = _build(run)
        if run.layout.is_main:
            print(_describe(run, model), flush=True)
        t0 = time.perf_counter()
        last = train(run, model, step_model, optimizer)
        if run.layout.is_main:
            print(f"trained to step {last} in {time.perf_counter() - t0:.1f} s", flush=True)
        _finish(run, model, last)
    except NonFiniteStop as err:
        if run.layout.is_main:
            print(f"fp8engine.train: error: {err}", file=sys.stderr, flush=True)
        return 3
    except (UsageError, CheckpointNotWritten) as err:  # raised on every rank alike (the ranks agreed)
        if run.layout.is_main:
            print(f"fp8engine.train: error: {err}", file=sys.stderr, flush=True)
        wait_for_all(run.layout)  # torchrun stops the other ranks at the first exit: rank 0 has said it by now
        return 2 if isinstance(err, UsageError) else 1
    except RuntimeError as err:  # torch.distributed's DistError and gloo's errors are RuntimeErrors
        if run.layout.world_size == 1:
            raise
        # A collective failed or timed out: another process died or hangs. Say so in one line and leave at once;
        # destroying the process group could wait on the dead peer.
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        print(f"fp8engine.train: error: rank {run.layout.rank}: a collective failed or timed out (another process "
              f"died or hangs; --dist-timeout {args.dist_timeout:g} s): {first}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    finally:
        if run.layout.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0



def command() -> None:
    """``python -m fp8engine.train`` / ``fp8engine-train``: :func:`main`, then exit with its status. A process of a
    multi-process run leaves without the interpreter's teardown once everything is written and flushed: a gloo or
    FSDP2 background thread still joinable at that point made a finished rank abort ("terminate called without an
    active exception", SIGABRT) now and then on the CPU, failing a run whose every step and checkpoint were done."""
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    command()
