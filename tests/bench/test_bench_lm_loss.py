"""``python -m fp8engine.bench lm_loss`` on the CPU: rows per backend with the difference from the first backend
(the GPU figures are the point; here, that the rows are timed and the fused loss agrees with the unfused one)."""
import json

from fp8engine.bench.lm_loss import main


def test_rows_per_backend(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--shapes", "300x32x1000", "--backends", "unfused,chunked", "--iters", "2",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["unfused", "chunked"] and rows[0]["ms fwd+bwd"] > 0
    # fp32 weights, bf16 autocast: the chunked loss matches the unfused one to bf16 GEMM rounding
    assert abs(rows[1]["loss diff"]) < 1e-3 and rows[1]["rel dX"] < 2e-2 and rows[1]["rel dW"] < 2e-2


def test_unavailable_backend_is_an_error_row(tmp_path):
    out = tmp_path / "rows.json"
    assert main(["--device", "cpu", "--shapes", "64x16x128", "--backends", "unfused,liger", "--iters", "1",
                 "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert "error" not in rows[0] and "error" in rows[1]
