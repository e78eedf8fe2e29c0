"""The training command's FP8 health record (``--fp8-stats N``): the ``fp8_stats`` field of ``metrics.jsonl`` and
the ``fp8_health.png`` picture drawn from it.

Schema: on every N-th step, that step's ``metrics.jsonl`` object (``step``, ``loss``, ...) also carries
``"fp8_stats"``, a list with one object per FP8 tensor role of the model, in module order::

    {"module": "layers.0.layernorm_mlp", "role": "fc1_input", "format": "e4m3", "amax": 3.19, "scale": 140.6,
     "underflow_pct": 0.0, "saturation_pct": 0.0}

``module`` (str), ``role`` (str), ``format`` (``"e4m3"`` / ``"e5m2"``, null when not counted), ``amax`` (max
``|x|`` over that step's casts, high-precision units, null when not counted), ``scale`` (float, multiply by it to
enter the FP8 range), ``underflow_pct`` and ``saturation_pct`` (percent, null when not counted): the fields of
:class:`fp8engine.fp8.stats.FP8StatsRow`, defined in :mod:`fp8engine.fp8.stats`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fp8engine.fp8.stats import FP8StatsRow
from fp8engine.training.checkpoint import atomic_write

__all__ = ["HEALTH_PLOT_NAME", "STATS_KEY", "rows_to_json", "rows_from_json", "plot_fp8_health"]

HEALTH_PLOT_NAME = "fp8_health.png"
#: The key of a metrics.jsonl object that holds the FP8 stats rows.
STATS_KEY = "fp8_stats"
#: Tensor kinds a role name ends with (a column of the picture each); a role ``fc1_input`` is GEMM ``fc1``, kind
#: ``input``.
_KINDS = ("input", "weight", "grad_output")
#: Heat-map colour range in percent (log scale): 1e-4 % is one value in a million; 0 % is drawn as the lowest.
_PCT_RANGE = (1e-4, 100.0)
#: Most GEMM names written beside a heat map; more and every k-th is named.
_MAX_LABELS = 40


def rows_to_json(rows: list[FP8StatsRow]) -> list[dict[str, Any]]:
    """``rows`` as the list stored under ``"fp8_stats"`` (JSON-ready dicts, field names as in the schema)."""
    return [row._asdict() for row in rows]


def rows_from_json(items: list[dict[str, Any]]) -> list[FP8StatsRow]:
    """Inverse of :func:`rows_to_json` (raises KeyError / TypeError on an object without the schema's fields)."""
    return [FP8StatsRow(**{field: item[field] for field in FP8StatsRow._fields}) for item in items]


def _split_role(module: str, role: str) -> tuple[str, str]:
    """``(GEMM label, kind)``: ``("layers.0.layernorm_mlp.fc1", "input")`` for role ``fc1_input``."""
    for kind in _KINDS:
        if role == kind or role.endswith("_" + kind):
            prefix = role[: -len(kind)].rstrip("_")
            return ".".join(p for p in (module, prefix) if p) or "(model)", kind
    return module or "(model)", role


def _series(records: list[dict[str, Any]]):
    """``(steps, gemms, kinds, values)``: ``values[field][kind]`` is a ``[len(gemms[kind])][len(steps)]`` list
    of floats (NaN where not recorded)."""
    stats = [(r["step"], r[STATS_KEY]) for r in records if r.get(STATS_KEY)]
    steps = [s for s, _ in stats]
    gemms: dict[str, list[str]] = {}
    index: dict[tuple[str, str], int] = {}
    for _, items in stats:
        for item in items:
            gemm, kind = _split_role(item["module"], item["role"])
            if (gemm, kind) not in index:
                index[(gemm, kind)] = len(gemms.setdefault(kind, []))
                gemms[kind].append(gemm)
    kinds = [k for k in _KINDS if k in gemms] + [k for k in gemms if k not in _KINDS]
    fields = ("amax", "scale", "underflow_pct", "saturation_pct")
    values = {f: {k: [[math.nan] * len(steps) for _ in gemms[k]] for k in kinds} for f in fields}
    for col, (_, items) in enumerate(stats):
        for item in items:
            gemm, kind = _split_role(item["module"], item["role"])
            for f in fields:
                v = item.get(f)
                values[f][kind][index[(gemm, kind)]][col] = math.nan if v is None else float(v)
    return steps, gemms, kinds, values


def plot_fp8_health(records: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Draw ``fp8_health.png`` from metrics records (those with ``"fp8_stats"``); returns False (and writes
    nothing) when there is none.

    One column per tensor kind (input, weight, grad_output); rows: amax and scale per GEMM over the steps (log
    scale, one line per GEMM coloured from the first layer to the last), then underflow % and saturation % as heat
    maps (GEMMs x steps, log colour scale, white = 0 %, grey = not recorded). Written atomically (PNG, Agg).
    """
    steps, gemms, kinds, values = _series(records)
    if not steps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    ncols = len(kinds)
    fig, axes = plt.subplots(4, ncols, figsize=(5.5 * ncols, 15), layout="constrained", squeeze=False)
    line_cmap = plt.get_cmap("viridis")
    heat_cmap = plt.get_cmap("Reds").copy()
    heat_cmap.set_bad("0.85")
    for c, kind in enumerate(kinds):
        n = len(gemms[kind])
        for r, (field, label) in enumerate((("amax", "amax (max |x|)"), ("scale", "scale"))):
            ax = axes[r, c]
            for g, series in enumerate(values[field][kind]):
                ax.plot(steps, series, ".-" if len(steps) < 30 else "-", linewidth=1, markersize=3,
                        color=line_cmap(g / max(1, n - 1)))
            if any(v > 0 for s in values[field][kind] for v in s if not math.isnan(v)):
                ax.set_yscale("log")
            ax.set_title(f"{kind}: {label}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for r, (field, label) in enumerate((("underflow_pct", "underflow %"), ("saturation_pct", "saturation %")),
                                           start=2):
            ax = axes[r, c]
            data = np.array(values[field][kind], dtype=float).reshape(n, len(steps))
            data = np.where(np.isnan(data), np.nan, np.clip(data, *_PCT_RANGE))  # 0 % -> the lowest colour
            image = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest", cmap=heat_cmap,
                              norm=LogNorm(*_PCT_RANGE))
            ax.set_title(f"{kind}: {label}")
            ax.set_xlabel("step")
            xt = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int))
            ax.set_xticks(xt, [str(steps[i]) for i in xt])
            every = max(1, math.ceil(n / _MAX_LABELS))
            ax.set_yticks(range(0, n, every), gemms[kind][::every], fontsize=6 if n > 12 else 8)
        if c == ncols - 1:
            fig.colorbar(image, ax=axes[2:, :].ravel().tolist(), label="% of values (log)", shrink=0.6)
            depth = ScalarMappable(Normalize(0, max(1, max(len(g) for g in gemms.values()) - 1)), line_cmap)
            fig.colorbar(depth, ax=axes[:2, :].ravel().tolist(), label="GEMM index (first layer -> last)",
                         shrink=0.6)
    fig.suptitle(title or "FP8 health")
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return True

