"""``python -m fp8engine.bench layer [--tp T]``: the TransformerEngine performance guide's layer, fwd+bwd.

``TransformerLayer(4096, 16384, 32)`` on ``[2048, 4, 4096]`` bf16 input, dropout 0, next to the plain PyTorch
bf16 pre-LN block of ../shared/ANCHORS.md, and torchao.float8 (tensorwise) on that block, eager and compiled;
our layer in FP8 compiled too (``torch.compile``, Inductor; the timings' warm-up steps compile it).
With ``--tp T`` (launch with ``torchrun --nproc-per-node T``) the layer runs tensor parallel with sequence
parallelism over T GPUs, same global batch; times are per step (every rank runs the step concurrently).

With ``--rounds R`` every row is timed R times, the rows interleaved (every row once, then every row again, ...),
and the medians over rounds are reported: the GPU's speed drifts over a run (rows timed later ran slower), and
interleaving spreads that drift over all rows.

``graphs compiled``: the graphs Dynamo captured while the row was timed, its warm-up included (0 for eager rows; 1
for a compiled layer without graph breaks that compiled once; more: a graph break or a re-compile after a failed
guard, and past Dynamo's cache-size limit the row runs eagerly, with Dynamo's guard checks on every call).

Two timings per row: ``ms`` = median of single steps, each after a synchronisation (the ANCHORS.md method: every
step also pays the host time until its first kernels reach the GPU); ``ms back-to-back`` = median over repeats of
5 steps issued without synchronisation, per step (consecutive training steps; host time overlaps GPU work).

FLOPs per step (fwd+bwd = 3x fwd): GEMMs ``2*t*(4*h*h + 2*h*f)`` per fwd, t = s*b tokens; causal attention
``2*b*s*s*h`` per fwd (QK^T and PV, halved by the mask).
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import fp8engine as fe
from fp8engine._cli import CommandParser
from fp8engine.bench.common import (add_layer_shape_args, cuda_graph_step, env_info, fwd_bwd_step, peak_memory_gib,
                                    print_table, time_back_to_back, time_fn, write_json)
from fp8engine.bench.torchao_ref import torchao_available, torchao_float8


class PlainBlock(nn.Module):
    """The plain PyTorch bf16 pre-LN GPT block of ANCHORS.md (LayerNorm, QKV, SDPA causal, proj, LayerNorm,
    fc1, GELU(tanh), fc2; residuals; all Linears with bias). Input/output ``[s, b, h]``."""

    def __init__(self, h: int, f: int, heads: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h, **kw), nn.LayerNorm(h, **kw)
        self.qkv, self.proj = nn.Linear(h, 3 * h, **kw), nn.Linear(h, h, **kw)
        self.fc1, self.fc2 = nn.Linear(h, f, **kw), nn.Linear(f, h, **kw)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def layer_flops(s: int, b: int, h: int, f: int) -> float:
    t = s * b
    return 3.0 * (2.0 * t * (4 * h * h + 2 * h * f) + 2.0 * b * s * s * h)


def gemm_rows(s: int, b: int, h: int, f: int, tp: int, device: str, iters: int) -> list[dict]:
    """Each of the layer's 12 FP8 GEMMs on pre-quantized operands (per rank shapes), with TFLOP/s."""
    from fp8engine.ops.gemm import fp8_mm

    t = s * b
    rows = []
    shapes = {"qkv": (h, 3 * h // tp), "proj": (h // tp, h), "fc1": (h, f // tp), "fc2": (f // tp, h)}
    one = torch.ones(1, device=device)
    for name, (k, n) in shapes.items():
        x = torch.randn(t, k, device=device).to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        dy = torch.randn(t, n, device=device).to(torch.float8_e5m2)
        w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()
        for gemm, fn in (("fprop", lambda: fp8_mm(x, one, w, one, torch.bfloat16, use_fast_accum=True)),
                         ("dgrad", lambda: fp8_mm(dy, one, w_t, one, torch.bfloat16)),
                         ("wgrad", lambda: fp8_mm(dy_t, one, x_t, one, torch.bfloat16))):
            ms = time_fn(fn, warmup=3, iters=iters, device=device)
            rows.append({"gemm": f"{name} {gemm}", "ms": ms, "TFLOP/s": 2.0 * t * k * n / ms / 1e9})
    return rows


def _cached_weights_step(model, x, dy, recipe):
    """Micro-batches 2+ of gradient accumulation (the performance guide's FP8 weight caching): one micro-batch
    with ``is_first_microbatch=True`` casts and keeps the FP8 weights, the timed steps pass False (no weight
    casts, no weight amaxes)."""
    fwd_bwd_step(model, x, dy, recipe, is_first_microbatch=True)()
    return fwd_bwd_step(model, x, dy, recipe, is_first_microbatch=False)


def _ours(h, f, heads, device, tp_group=None, fuse_wgrad=False):
    from fp8engine.modules.transformer import TransformerLayer

    kw = dict(set_parallel_mode=True, tp_group=tp_group, sequence_parallel=True) if tp_group is not None else {}
    layer = TransformerLayer(h, f, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                             device=device, fuse_wgrad_accumulation=fuse_wgrad, **kw)
    if fuse_wgrad:  # the fp32 gradient-accumulation buffers of the GEMM weights (Megatron's main_grad)
        for p in layer.parameters():
            if p.dim() == 2:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return layer


_CACHED = "fp8engine TransformerLayer fp8 delayed, FP8 weights cached (is_first_microbatch=False)"


def run_single(args) -> list[dict]:
    s, b, h, f, heads, dev = args.seq, args.batch, args.hidden, args.ffn, args.heads, args.device
    torch.manual_seed(0)
    x = torch.randn(s, b, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    plain = PlainBlock(h, f, heads, device=dev, dtype=torch.bfloat16)
    ours = _ours(h, f, heads, dev)
    cases = [("plain PyTorch block bf16 eager", plain, None), ("fp8engine TransformerLayer bf16", ours, None),
             ("fp8engine TransformerLayer fp8 delayed", ours, fe.DelayedScaling()),
             ("fp8engine TransformerLayer fp8 current", ours, fe.CurrentScaling()),
             ("fp8engine TransformerLayer fp8 block (Float8BlockScaling)", ours, fe.Float8BlockScaling()),
             ("fp8engine TransformerLayer fp8 delayed, fuse_wgrad_accumulation (fp32 main_grad)",
              _ours(h, f, heads, dev, fuse_wgrad=True), fe.DelayedScaling()),
             (_CACHED, ours, fe.DelayedScaling())]
    if dev == "cuda":  # the A/B of fc1's GELU epilogue: the same layer with the GEMM + Triton GELU kernel
        no_epilogue = _ours(h, f, heads, dev)
        no_epilogue.layernorm_mlp.gelu_epilogue = False
        cases.append(("fp8engine TransformerLayer fp8 delayed, fc1 GEMM + GELU kernel (no epilogue)", no_epilogue,
                      fe.DelayedScaling()))
    if not args.no_torchao and dev == "cuda" and torchao_available():
        cases += [("torchao.float8 tensorwise eager", torchao_float8(plain), None),
                  ("torchao.float8 tensorwise compile", torchao_float8(plain, compile=True), None)]
    if dev == "cuda" and not args.no_compile:
        cases.append(("plain PyTorch block bf16 compile", torch.compile(plain), None))
        for name, recipe in (("delayed", fe.DelayedScaling()), ("current", fe.CurrentScaling())):
            cases.append((f"fp8engine TransformerLayer fp8 {name} compile",
                          torch.compile(_ours(h, f, heads, dev)), recipe))
    if dev == "cuda" and args.graph:
        from fp8engine.modules.graph import make_graphed_callables

        recipe = fe.DelayedScaling()
        graphed = make_graphed_callables(_ours(h, f, heads, dev), (x,), fp8_recipe=recipe)
        cases.append(("fp8engine TransformerLayer fp8 delayed, CUDA graph (make_graphed_callables)", graphed, recipe))
    from torch._dynamo.utils import counters

    flops = layer_flops(s, b, h, f)
    times = {name: ([], [], [], []) for name, _, _ in cases}  # single, back-to-back, peak GiB, graphs per round
    errors: dict[str, str] = {}  # a row that fails says so in its row; the others are still timed
    for _ in range(args.rounds):  # rows interleaved: a drift of the GPU's speed over the run hits all rows alike
        for name, model, recipe in cases:
            if name in errors:
                continue
            peak_memory_gib(reset=True)
            graphs = counters["stats"]["unique_graphs"]
            try:
                step = (_cached_weights_step(model, x, dy, recipe) if name == _CACHED
                        else fwd_bwd_step(model, x, dy, recipe))
                times[name][0].append(time_fn(step, warmup=3, iters=args.iters, device=dev))
                times[name][1].append(time_back_to_back(step, steps=5, repeats=args.iters, device=dev))
            except Exception as err:  # noqa: BLE001 -- reported in the row, never hidden
                errors[name] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
                continue
            times[name][2].append(peak_memory_gib())
            times[name][3].append(counters["stats"]["unique_graphs"] - graphs)
    rows = []
    for name, (single, b2b, peak, graphs) in times.items():
        if name in errors:
            rows.append({"impl": name, "error": errors[name]})
            continue
        ms = statistics.median(single)
        rows.append({"impl": name, "ms": ms, "TFLOP/s": flops / ms / 1e9, "ms back-to-back": statistics.median(b2b),
                     "peak_GiB": max(peak), "ms per round": " / ".join(f"{v:.2f}" for v in single),
                     "graphs compiled": sum(graphs)})
    return rows


def run_tp(args) -> list[dict]:
    import torch.distributed as dist

    from fp8engine.parallel.utils import get_group_rank

    tp = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    group = dist.new_group(list(range(tp)))
    s, b, h, f, heads = args.seq, args.batch, args.hidden, args.ffn, args.heads
    torch.manual_seed(0)
    ours = _ours(h, f, heads, "cuda", tp_group=group)
    x = torch.randn(s // tp, b, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    rows, flops = [], layer_flops(s, b, h, f)
    recipes = (("bf16", None), ("fp8 delayed", fe.DelayedScaling()), ("fp8 block", fe.Float8BlockScaling()))
    for graphed in (False, True) if args.graph else (False,):
        for name, recipe in recipes:
            peak_memory_gib(reset=True)
            step = fwd_bwd_step(ours, x, dy, recipe, amax_group=group)
            if graphed:  # as the training command runs it under torchrun: the step captured, collectives included
                step = cuda_graph_step(step)
            ms = time_fn(step, warmup=3, iters=args.iters)
            rows.append({"impl": f"fp8engine TransformerLayer {name} tp={tp} sp" + (", CUDA graph" if graphed else ""),
                         "ms": ms, "TFLOP/s per GPU": flops / tp / ms / 1e9, "peak_GiB": peak_memory_gib()})
            if local == 0:  # as it is measured: a run cut by a time limit still reports its rows
                print(f"  {rows[-1]['impl']}: {ms:.3f} ms", flush=True)
    if get_group_rank(group) == 0:
        rows += [{"impl": r["gemm"], "ms": r["ms"], "TFLOP/s per GPU": r["TFLOP/s"]}
                 for r in gemm_rows(s, b, h, f, tp, "cuda", args.iters)]
    dist.destroy_process_group()
    return rows if local == 0 else []


def main(argv=None) -> int:
    p = CommandParser(prog="python -m fp8engine.bench layer", description=__doc__)
    add_layer_shape_args(p, seq=2048, batch=4, hidden=4096, ffn=16384, heads=32)  # the guide's layer
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="time the rows this many times, interleaved; report medians")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--graph", action="store_true", help="add our layer captured in CUDA graphs (with --tp: every "
                                                       "precision's fwd+bwd step captured, collectives included)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tp > 1:
        rows = run_tp(args)
        if rows:
            print(f"# layer tp={args.tp}  {env_info()}")
            print_table(rows)
            write_json(args.json, "layer_tp", rows)
        return 0
    print(f"# layer fwd+bwd [{args.seq}, {args.batch}, {args.hidden}] ffn {args.ffn} heads {args.heads}  {env_info()}")
    rows = run_single(args)
    print_table(rows)
    if args.device == "cuda":
        print_table(gemm_rows(args.seq, args.batch, args.hidden, args.ffn, 1, args.device, args.iters))
    write_json(args.json, "layer", rows)
    return 0
