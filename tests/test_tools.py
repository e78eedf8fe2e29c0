"""The GPU tools in tools/ stay runnable and documented: every Python tool imports and answers ``--help`` with exit 0
on a machine without a GPU (they parse their options before touching CUDA), and tools/README.md names every file
in tools/ (and nothing that is not there)."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"

# One interpreter for all tools (torch is imported once): run each as __main__ with argv [path, --help] and report
# "name exit-code first-usage-line" per tool.
_RUN_ALL = r"""
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    first = (out.getvalue().splitlines() or [""])[0]
    print(path.rsplit("/", 1)[-1], code, first, sep="\t")
"""


def test_every_python_tool_answers_help_without_a_gpu():
    tools = sorted(str(p) for p in TOOLS.glob("*.py"))
    assert tools
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _RUN_ALL, *tools], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {name: (code, first) for name, code, first in (line.split("\t") for line in proc.stdout.splitlines())}
    assert sorted(results) == sorted(Path(t).name for t in tools)
    for name, (code, first) in results.items():
        assert code == "0" and first.startswith(f"usage: {name}"), (name, code, first)


def test_readme_names_every_tool():
    readme = (TOOLS / "README.md").read_text()
    named = set(re.findall(r"tools/([\w.]+\.(?:py|sh))\b", readme))
    present = {p.name for p in TOOLS.iterdir() if p.suffix in (".py", ".sh")}
    assert named == present, (sorted(named - present), sorted(present - named))


def test_layer_host_time_sections_runs_and_restores_the_wrapped_functions():
    """``tools/layer_host_time.py --sections`` on the CPU: one table row per timed part (the fused step's forward and
    backward among them), and every function it wrapped is the original object again afterwards."""
    import contextlib
    import io
    import runpy
    from types import SimpleNamespace

    import torch

    import fp8engine as fe
    import fp8engine.ops.layer as fused
    from fp8engine.modules.transformer import TransformerLayer

    tool = runpy.run_path(str(TOOLS / "layer_host_time.py"), run_name="tool")
    before = (fused.norm_fwd, fused._FP8TransformerLayer.__dict__["forward"], TransformerLayer._fused_plan)
    layer = TransformerLayer(128, 256, 2, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16)
    x = torch.randn(16, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    args = SimpleNamespace(device="cpu", steps=1, seq=16, batch=1, hidden=128, ffn=256, heads=2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tool["_sections"](layer, x, torch.randn_like(x), fe.DelayedScaling(), args)
    text = out.getvalue()
    assert "fused step forward (all of it)" in text and "fused step backward (all of it)" in text
    assert "autocast exit (scale update)" in text
    after = (fused.norm_fwd, fused._FP8TransformerLayer.__dict__["forward"], TransformerLayer._fused_plan)
    assert all(a is b for a, b in zip(before, after))


def test_step_profile_overlap_arithmetic():
    """tools/step_profile.py's union and overlap of kernel intervals (us in, ms out), which report how much NCCL time
    hides behind compute: overlapping, nested, touching and disjoint intervals, against a brute-force count."""
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("step_profile", TOOLS / "step_profile.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool._union_ms([(0, 1000), (500, 1500), (2000, 2500)]) == 2.0
    assert tool._overlap_ms([(0, 1000), (2000, 3000)], [(500, 2500), (2600, 2700)]) == 1.1
    assert tool._overlap_ms([(0, 10)], [(10, 20)]) == 0.0
    rng = random.Random(0)
    for _ in range(20):
        a = [(s, s + rng.randint(1, 30)) for s in (rng.randint(0, 200) for _ in range(8))]
        b = [(s, s + rng.randint(1, 30)) for s in (rng.randint(0, 200) for _ in range(8))]
        covered = lambda iv, t: any(s <= t < e for s, e in iv)  # noqa: E731 -- per integer microsecond
        want = sum(covered(a, t) and covered(b, t) for t in range(0, 240)) / 1e3
        assert abs(tool._overlap_ms(a, b) - want) < 1e-12
