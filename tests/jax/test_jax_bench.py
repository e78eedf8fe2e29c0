"""The JAX benchmark runs end to end at a tiny size on CPU and writes its JSON (numbers are not checked)."""
import json

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from fp8engine.bench import jax_dense  # noqa: E402


def test_bench_runs_small(tmp_path, capsys):
    out = tmp_path / "jax.json"
    argv = ["--m", "64", "--k", "32", "--n", "48", "--warmup", "1", "--iters", "10", "--json", str(out)]
    assert jax_dense.main(argv) == 0
    table = capsys.readouterr().out
    assert "| impl | ms | TFLOP/s |" in table
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == set(jax_dense.IMPLS)
    ours = next(r for r in rows if r["impl"].startswith("fp8engine"))
    assert ours["ms"] > 0 and ours["tflops"] > 0


def test_bench_rejects_too_few_iters():
    with pytest.raises(SystemExit):
        jax_dense.main(["--iters", "5"])
