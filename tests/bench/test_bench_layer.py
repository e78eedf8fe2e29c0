"""``python -m fp8engine.bench layer``: one failing row is reported in its row and the other rows are still timed
(issue 42: the whole table was lost to the compiled row's error on the H100)."""
import argparse

import torch

import fp8engine as fe
import fp8engine.bench.layer as bench_layer


def test_a_failing_row_is_reported_and_the_others_are_timed(monkeypatch, capsys):
    real_step = bench_layer.fwd_bwd_step

    def step(model, x, dy, recipe=None, **kw):
        if isinstance(recipe, fe.CurrentScaling):
            raise RuntimeError("scale_b must be float32\nsecond line of the message")
        return real_step(model, x, dy, recipe, **kw)

    monkeypatch.setattr(bench_layer, "fwd_bwd_step", step)
    args = argparse.Namespace(seq=16, batch=2, hidden=128, ffn=256, heads=4, device="cpu", iters=1, rounds=1,
                              no_torchao=True, no_compile=True, graph=False)
    torch.manual_seed(0)
    rows = bench_layer.run_single(args)
    by_name = {r["impl"]: r for r in rows}
    failed = by_name["fp8engine TransformerLayer fp8 current"]
    assert failed["error"] == "RuntimeError: scale_b must be float32" and "ms" not in failed
    timed = [r for r in rows if "error" not in r]
    assert len(timed) == len(rows) - 1 and all(r["ms"] > 0 for r in timed)
    text = bench_layer.print_table(rows)
    assert "RuntimeError: scale_b must be float32" in text and "| error |" in text.splitlines()[0] + " |"
