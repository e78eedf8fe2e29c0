"""``python -m fp8engine.bench jax``: FP8 DenseGeneral (fp8engine.jax) vs bf16 ``flax.linen.DenseGeneral`` vs
Flax's own ``fp8_ops`` (``Fp8DirectDotGeneralOp``), forward + backward under ``jax.jit``.

One step is ``y = x @ W`` (``x`` ``[M, K]`` bf16, ``W`` ``[K, N]``) and the gradients with respect to ``x``,
``W`` (and the FP8 metas), from ``sum(y * dy)``: three GEMMs, ``6 * M * K * N`` FLOPs. Reported: median wall
time of ``--iters`` (>= 10) steps after ``--warmup`` steps, each step ended by ``block_until_ready``, and the
TFLOP/s that implies. Options ``--m/--k/--n`` (default 8192/4096/16384, the issue's size) let it run small
on CPU. Imports only jax/flax (no torch).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from typing import Callable, Optional

from fp8engine._cli import CommandParser

__all__ = ["main"]


def _time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` (its outputs blocked on), after ``warmup`` discarded calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _step_fn(model, variables, x, dy, meta_collections):
    """A jitted fwd+bwd step: grads of ``sum(y * dy)`` w.r.t. x, params and the given meta collections."""
    import jax
    import jax.numpy as jnp

    params = variables["params"]
    metas = {c: variables[c] for c in meta_collections if c in variables}

    @jax.jit
    def step(params, metas, x):
        def loss(params, metas, x):
            y = model.apply({"params": params, **metas}, x)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(params, metas, x)

    return lambda: step(params, metas, x)


def _bench_ours(x, dy, n, warmup, iters):
    import jax
    import jax.numpy as jnp

    import fp8engine.jax as fj

    model = fj.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    with fj.fp8_autocast(enabled=True):
        variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
        return _time_ms(_step_fn(model, variables, x, dy, [fj.FP8_COLLECTION]), warmup, iters)


def _bench_flax_bf16(x, dy, n, warmup, iters):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    model = nn.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    return _time_ms(_step_fn(model, variables, x, dy, []), warmup, iters)


def _bench_flax_fp8(x, dy, n, warmup, iters):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    model = nn.DenseGeneral(
        n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp
    )
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
    return _time_ms(_step_fn(model, variables, x, dy, [fp8_ops.OVERWRITE_WITH_GRADIENT]), warmup, iters)


IMPLS = {
    "fp8engine.jax DenseGeneral (FP8)": _bench_ours,
    "flax.linen.DenseGeneral (bf16)": _bench_flax_bf16,
    "flax fp8_ops Fp8DirectDotGeneralOp (FP8)": _bench_flax_fp8,
}


def _markdown(rows) -> str:
    lines = ["| impl | ms | TFLOP/s |", "|---|---|---|"]
    for r in rows:
        ms = "unavailable" if r["ms"] is None else f"{r['ms']:.3f}"
        tf = "" if r["tflops"] is None else (f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}")
        lines.append(f"| {r['impl']} | {ms} | {tf} |" + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


def _parse(argv):
    p = CommandParser(prog="python -m fp8engine.bench jax", description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.iters < 10:
        p.error("--iters must be >= 10 (the median of at least 10 timed steps is reported)")
    return args


def main(argv: Optional[list] = None) -> int:
    """Run the benchmark; returns 0 (an implementation that cannot run is reported, not fatal)."""
    args = _parse([] if argv is None else list(argv))
    import jax
    import jax.numpy as jnp

    kx, kd = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (args.m, args.k), jnp.bfloat16)
    dy = jax.random.normal(kd, (args.m, args.n), jnp.bfloat16) * 0.01
    flops = 6.0 * args.m * args.k * args.n
    rows = []
    for name, fn in IMPLS.items():
        try:
            ms = fn(x, dy, args.n, args.warmup, args.iters)
            rows.append({"impl": name, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "note": ""})
        except (ImportError, AttributeError, TypeError, NotImplementedError) as err:
            rows.append({"impl": name, "ms": None, "tflops": None, "note": f"({type(err).__name__}: {err})"})
    device = jax.devices()[0]
    header = (
        f"JAX {jax.__version__} on {device.platform} ({getattr(device, 'device_kind', '?')}), "
        f"M={args.m} K={args.k} N={args.n}, fwd+bwd under jit, median of {args.iters} after {args.warmup} warm-up"
    )
    print(header)
    print(_markdown(rows), flush=True)
    if args.json_path:
        env = {"jax": jax.__version__, "device": str(getattr(device, "device_kind", device.platform)),
               "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
        shape = {"m": args.m, "k": args.k, "n": args.n, "warmup": args.warmup, "iters": args.iters}
        with open(args.json_path, "w") as f:
            json.dump({"benchmark": "jax_dense", "env": env, "shape": shape, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
