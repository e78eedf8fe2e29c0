"""The training command's flags: the parser, range and combination checks, per-model defaults, and the checks of
the flags against the model, the device and this torch (each raising :class:`~fp8engine.training.UsageError`: one
line, exit status 2, before anything is written). Used by :mod:`fp8engine.train`."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path
from typing import Optional

import torch

import fp8engine
from fp8engine._cli import CommandParser
from fp8engine.models import GPT_CONFIGS, GPTConfig
from fp8engine.ops.lm_head import LM_LOSS_BACKENDS
from fp8engine.training import UsageError
from fp8engine.training.distributed import env_world_size

__all__ = ["build_parser", "check_flags", "check_out", "fill_defaults", "resolve_device", "check_block_run",
           "check_fp8_dims", "check_precision", "check_lm_loss", "seq_len_warning", "MODEL_DEFAULTS", "RECIPES"]

#: Per-model defaults for options left unset: (steps, batch size, learning rate).
MODEL_DEFAULTS = {"tiny": (600, 16, 3e-3), "small": (5000, 64, 1e-3), "gpt2-124m": (20000, 16, 6e-4),
                   "1b": (20000, 8, 3e-4), "8b": (20000, 1, 1.5e-4)}
#: ``--recipe`` -> the recipe class (built with its defaults; Float8BlockScaling: E4M3, power-of-two scales).
RECIPES = {"delayed": fp8engine.DelayedScaling, "current": fp8engine.CurrentScaling,
            "block": fp8engine.Float8BlockScaling}
#: ``--fsdp-layers-per-group`` when not given: transformer layers per FSDP2 group (1b over 2 H200s, bf16: 171.4 ms
#: per step with 4, 188.0 with 1, docs/benchmarks.md).
FSDP_LAYERS_PER_GROUP = 4


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where X is the value a flag takes when left out: not for flags whose default
    is filled in later (``None``: their help says how, per model where it depends on ``--model``) nor for on/off
    switches (``--compile``, ``--no-cuda-graphs``), whose name says what giving them does."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


def _per_model(value) -> str:
    """``"tiny 600, small 5000, ..."``: ``value(name, config)`` of every named model, for ``--help``."""
    return ", ".join(f"{name} {value(name, config)}" for name, config in GPT_CONFIGS.items())


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The training command's parser (every flag, its help and default; ranges are checked by :func:`check_flags`)."""
    p = CommandParser(prog="python -m fp8engine.train", description=description,
                      formatter_class=_HelpFormatter)  # adds --version
    p.add_argument("--data", help="text file (byte-level tokens) or directory with nanoGPT train.bin/val.bin "
                                  "(uint16); default: this Python's standard-library .py sources")
    p.add_argument("--model", default="tiny", choices=list(GPT_CONFIGS), help="named model size")
    p.add_argument("--n-layer", type=int, help="override the model's layer count (per model: "
                                                f"{_per_model(lambda _, c: c.n_layer)})")
    p.add_argument("--n-head", type=int, help="override the model's attention heads (per model: "
                                               f"{_per_model(lambda _, c: c.n_head)})")
    p.add_argument("--hidden-size", type=int, help="override the model's width (per model: "
                                                    f"{_per_model(lambda _, c: c.hidden_size)})")
    p.add_argument("--ffn-hidden-size", type=int, help="override the model's MLP width (per model: "
                                                        f"{_per_model(lambda _, c: c.ffn_hidden_size)})")
    p.add_argument("--precision", default="fp8", choices=("fp8", "bf16", "fp32"),
                   help="the transformer layers' GEMMs in FP8 (emulated on a CPU), or everything in bf16 autocast "
                        "or fp32; parameters stay fp32")
    p.add_argument("--recipe", default="delayed", choices=tuple(RECIPES),
                   help="FP8 scaling recipe: per-tensor delayed or current scaling, or block (Float8BlockScaling: "
                        "1x128 / 128x128 block scales; model dims multiples of 128)")
    p.add_argument("--steps", type=int, help="optimizer steps (default per model: "
                                              f"{_per_model(lambda name, _: MODEL_DEFAULTS[name][0])})")
    p.add_argument("--stop-at", type=int, help="end this run after this step, checkpointed, keeping the LR "
                                               "schedule of --steps; continue with --resume")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch (default per model: "
                                                   f"{_per_model(lambda name, _: MODEL_DEFAULTS[name][1])})")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, the context the model is built for (default: "
                                                f"the model's, {_per_model(lambda _, c: c.max_seq_len)}; longer "
                                                "runs with a warning: rotary positions, nothing learned per position)")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate (default per model: "
                                             f"{_per_model(lambda name, _: f'{MODEL_DEFAULTS[name][2]:g}')})")
    p.add_argument("--warmup-steps", type=int, help="linear warm-up steps before the cosine decay "
                                                    "(default: --steps // 10, at most 100)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices")
    p.add_argument("--dropout", type=float, help="dropout probability (default per model: "
                                                  f"{_per_model(lambda _, c: f'{c.dropout:g}')})")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--eval-interval", type=int, help="evaluate every N steps and at the end (default: --steps // 4)")
    p.add_argument("--eval-iters", type=int, default=20, help="validation batches per evaluation")
    p.add_argument("--seed", type=int, default=1337, help="seed of the initialisation, the batches, dropout and "
                                                           "the sample")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, run every step eagerly instead of capturing the training step in a CUDA graph "
                        "after two eager steps (the default for single-process CUDA runs)")
    p.add_argument("--no-fused-layer", dest="fused_layer", action="store_false",
                   help="under per-tensor FP8, run each transformer layer's sublayers one by one instead of the "
                        "layer step as one autograd node (fp8engine.ops.layer; same math, more host time)")
    p.add_argument("--lm-loss", default="chunked", choices=LM_LOSS_BACKENDS,
                   help="the LM head + cross-entropy: fused and chunked in plain PyTorch (vocab-parallel with --tp), "
                        "liger-kernel's or cut-cross-entropy's fused Triton loss (CUDA, no --tp; pip install "
                        "fp8engine[lm-loss]), or unfused (the [tokens, vocab] logits materialized)")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --precision fp8, run the tied LM head's GEMMs in FP8 too (its loss is then the unfused "
                        "cross-entropy; the vocabulary must be a multiple of 16, of 128 with --recipe block)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun; the other "
                                                     "processes form data-parallel replicas)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: norms/dropout on sequence shards")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the data-parallel replicas' parameters, gradients and AdamW state with FSDP2 "
                        "(fully_shard per group of layers; composes with --tp as a 2-D mesh) instead of replicating "
                        "them")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fsdp and --precision fp8 (delayed or current scaling): all-gather the FP8 GEMM "
                        "weights as FP8 bytes (half the bytes of the default bf16 all-gather; slower on 2 "
                        "NVLink H100s for the 1b model, docs/benchmarks.md)")
    p.add_argument("--fsdp-reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="with --fsdp: free each layer's gathered parameters after its forward and gather them "
                        "again for its backward (ZeRO-3, the default); --no-fsdp-reshard-after-forward keeps them "
                        "until the backward (one all-gather per layer and step instead of two; the gathered "
                        "layers' memory held across the forward: torchtitan's reshard_after_forward=False)")
    p.add_argument("--fsdp-layers-per-group", type=int, metavar="N",
                   help=f"with --fsdp: transformer layers per FSDP2 group, all-gathered and reduce-scattered "
                        f"together (fewer, larger collectives and less of FSDP2's per-group host work; the memory "
                        f"of N gathered layers; default {FSDP_LAYERS_PER_GROUP})")
    p.add_argument("--fsdp-reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="with --fsdp: dtype of the gradients' reduce-scatter (fp32: the replicas' average rounded "
                        "once, as DDP's fp32 all-reduce; bf16: half the bytes, FSDP2's MixedPrecisionPolicy "
                        "reduce_dtype)")
    p.add_argument("--out", help="directory for metrics.jsonl, checkpoint.pt and loss.png")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--sample-tokens", type=int, default=300, help="tokens to generate at the end (0: none)")
    p.add_argument("--skip-nonfinite", type=int, default=0, metavar="N",
                   help="skip up to N optimizer steps in a row whose loss or gradient norm is NaN/inf (nothing "
                        "is updated from them), then stop; 0: stop at the first one (exit status 3)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                   help="checkpoints kept in --out (newest first; --resume falls back to an older one when the "
                        "newest is damaged); at least 2")
    p.add_argument("--fp8-stats", type=int, default=0, metavar="N",
                   help="every N steps record each FP8 tensor's amax, scale, underflow %% and saturation %% into "
                        "metrics.jsonl and draw fp8_health.png (with CUDA graphs those steps run eagerly); 0: off")
    p.add_argument("--dist-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="multi-process runs: a collective waiting longer than this (another process died or "
                        "hangs) ends the run with an error")
    return p


#: Integer flags that must be >= the bound when given (0 is a value, not "unset").
_MIN_INT = {"steps": 1, "stop_at": 1, "batch_size": 1, "seq_len": 1, "n_layer": 1, "n_head": 1, "hidden_size": 1,
            "ffn_hidden_size": 1, "grad_accum": 1, "eval_interval": 1, "eval_iters": 1, "tp": 1,
            "warmup_steps": 0, "sample_tokens": 0, "skip_nonfinite": 0, "keep_checkpoints": 2, "seed": 0,
            "fp8_stats": 0, "fsdp_layers_per_group": 1}
#: Largest --seed: torch generators take 64-bit seeds, and tensor parallelism adds up to 2718 + tp rank to it.
_MAX_SEED = 2**63 - 1


def check_flags(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for a numeric flag out of range (run before any default is filled in)."""
    for name, low in _MIN_INT.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}; got {value}")
    if args.seed > _MAX_SEED:
        raise UsageError(f"--seed must be between 0 and {_MAX_SEED}; got {args.seed}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive finite number; got {args.lr}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise UsageError(f"--weight-decay must be a finite number >= 0; got {args.weight_decay}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1); got {args.dropout}")
    if not (math.isfinite(args.dist_timeout) and args.dist_timeout > 0):
        raise UsageError(f"--dist-timeout must be a positive number of seconds; got {args.dist_timeout}")


def check_out(out: Path) -> None:
    """Raise :class:`UsageError` unless ``out`` is a writable directory or can be created (writes nothing)."""
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out} is a file; give a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(f"--out {out} is not writable by this user; choose another directory")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out} cannot be created: {parent} is not writable by this user")


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    check_flags(args)
    steps, batch, lr = MODEL_DEFAULTS[args.model]
    args.steps = steps if args.steps is None else args.steps
    args.batch_size = batch if args.batch_size is None else args.batch_size
    args.lr = lr if args.lr is None else args.lr
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.steps // 10)
    if args.eval_interval is None:
        args.eval_interval = max(1, args.steps // 4)
    for name in ("steps", "batch_size", "grad_accum", "eval_interval", "eval_iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        raise UsageError(f"--stop-at must be between 1 and --steps ({args.steps}); got {args.stop_at}")
    if args.lr <= 0 or args.warmup_steps < 0:
        raise UsageError("--lr must be positive and --warmup-steps non-negative")
    args.world_size = env_world_size()
    if args.resume and not args.out:
        raise UsageError("--resume needs --out DIR, the directory of the run to continue")
    if args.fp8_stats and args.precision != "fp8":
        raise UsageError(f"--fp8-stats counts FP8 casts; it needs --precision fp8 (got --precision {args.precision})")
    if args.fp8_stats and args.recipe == "block":
        raise UsageError("--fp8-stats counts per-tensor FP8 casts; block-scaled casts (--recipe block) are not "
                         "counted: drop --fp8-stats or use --recipe delayed/current")
    if args.fp8_lm_head and args.precision != "fp8":
        raise UsageError(f"--fp8-lm-head runs the LM head in FP8; it needs --precision fp8 (got --precision "
                         f"{args.precision})")
    if args.lm_loss in ("liger", "cce") and args.tp > 1:
        raise UsageError(f"--lm-loss {args.lm_loss} has no vocab-parallel form; with --tp use --lm-loss chunked "
                         "(fused, vocab-parallel) or unfused")
    if args.fp8_stats and args.compile:
        raise UsageError("--fp8-stats counts the casts of eager FP8 code; a torch.compile-d model is not counted: "
                         "drop --compile or --fp8-stats")
    return args


def seq_len_warning(args: argparse.Namespace) -> Optional[str]:
    """The warning (one line) for a ``--seq-len`` longer than the named model's context, else None.

    Not an error: the GPT's positions are rotary (:class:`fp8engine.models.GPT` builds the rotation for
    ``max_seq_len = --seq-len``), so no table learned per position runs out; the model trains at the longer context
    from its first step. But it is no longer the named model, and attention's time and memory grow with the square of
    the length, so the run says so.
    """
    context = GPT_CONFIGS[args.model].max_seq_len
    if args.seq_len is None or args.seq_len <= context:
        return None
    return (f"--seq-len {args.seq_len} is longer than the {args.model} model's context ({context}): the model is built "
            f"for {args.seq_len} tokens (rotary positions, nothing learned per position) and attention's time and "
            f"memory grow with the square of it; pass --seq-len {context} or less for the {args.model} model as named")


def resolve_device(requested: Optional[str]) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to this torch "
                         f"({torch.__version__}); use --device cpu")
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def check_block_run(args: argparse.Namespace, config: GPTConfig) -> None:
    """:class:`UsageError` for what ``--recipe block`` cannot run: per-rank dims not multiples of 128 at ``--tp``
    (one rank was checked with the model), and ``--compile``: the Inductor of torch 2.11 fails on the block-scaled
    casts' reference code (CPU: ``AssertionError: unexpected group`` in its loop fusion), while torch 2.13's CPU
    Inductor trains a 1-layer GPT to the eager losses; refused until it is checked on the GPU (``aot_eager`` traces
    the casts exactly)."""
    if args.compile:
        raise UsageError("--compile is not supported with --recipe block yet (Inductor cannot compile the "
                         "block-scaled casts); drop --compile, or use --recipe delayed / current")
    if args.tp > 1:  # check_layout checked multiples of 16
        check_fp8_dims(args, config, args.tp)


def check_fp8_dims(args: argparse.Namespace, config: GPTConfig, tp_size: int) -> None:
    """:class:`UsageError` when the model's per-rank GEMM dims do not suit ``--recipe`` (multiples of 16; of 128
    for ``block``)."""
    block = args.recipe == "block"
    problems = config.fp8_problems(tp_size, align=fp8engine.Float8BlockScaling.BLOCK_SIZE if block else 16)
    if not problems:
        return
    if block:
        raise UsageError(f"--recipe block cannot run --model {args.model}"
                         f"{f' at --tp {tp_size}' if tp_size > 1 else ''}: {problems[0]}; use sizes (per rank) "
                         "that are multiples of 128, or --recipe delayed / current")
    raise UsageError(f"--model {args.model} cannot run in FP8: {problems[0]}; use sizes that are "
                     "multiples of 16 or --precision bf16")


def check_lm_loss(args: argparse.Namespace, device: torch.device) -> None:
    """:class:`UsageError` when ``--lm-loss liger`` / ``cce`` cannot run here: not on CUDA, or the package is not
    installed (the loss itself would raise RuntimeError at the first step)."""
    if args.lm_loss not in ("liger", "cce"):
        return
    if device.type != "cuda":
        raise UsageError(f"--lm-loss {args.lm_loss} runs Triton kernels on CUDA only; on {device.type} use "
                         "--lm-loss chunked")
    module, package = (("liger_kernel", "liger-kernel") if args.lm_loss == "liger"
                       else ("cut_cross_entropy", "cut-cross-entropy"))
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"--lm-loss {args.lm_loss} needs the {package} package: pip install {package} (or "
                         "fp8engine[lm-loss]), or use --lm-loss chunked")


def check_precision(args: argparse.Namespace, device: torch.device) -> None:
    if args.precision == "fp8":
        ok, reason = fp8engine.is_fp8_available(return_reason=True, device=device)
        if not ok:
            raise UsageError(f"--precision fp8 cannot run on {device}: {reason} Use --precision bf16")
