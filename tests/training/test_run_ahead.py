"""The training loop reads a step's loss one step behind on CUDA (``fp8engine.train.launch_step`` /
``finish_step``): step N's loss is read once step N + 1 is queued, so the GPU does not wait for the host between
steps, while a step that evaluates, checkpoints or ends the run is read before the next step is launched (the
weights an evaluation or a checkpoint sees are that step's).

CPU steps are synchronous, so the loop reads them at once; to exercise the one-step-behind order on the CPU, the
launched steps are given a stand-in for the CUDA event (``ready``) that the loop waits on (``--device cpu``: on a
GPU machine the command's default device is the GPU, whose steps run one behind without it). The metrics must be those
of the plain loop (the math does not depend on when the host reads)."""
import json

import fp8engine.train as T


REAL = (T.launch_step, T.finish_step, T.evaluate)


class _Ready:
    def synchronize(self):
        pass


def _run(tmp_path, monkeypatch, name, ahead: bool, log: list):
    real_launch, real_finish, real_eval = REAL

    def launch(run, step_fn, optimizer, step, model=None):
        log.append(("launch", step))
        launched = real_launch(run, step_fn, optimizer, step, model)
        if ahead:
            launched.ready = _Ready()
        return launched

    def finish(run, launched, *args):
        log.append(("read", launched.step))
        return real_finish(run, launched, *args)

    def evaluate(run, model):
        log.append(("eval", None))
        return real_eval(run, model)

    monkeypatch.setattr(T, "launch_step", launch)
    monkeypatch.setattr(T, "finish_step", finish)
    monkeypatch.setattr(T, "evaluate", evaluate)
    out = tmp_path / name
    assert T.main(["--device", "cpu", "--model", "tiny", "--n-layer", "1", "--seq-len", "32", "--batch-size", "2", "--steps", "7",
                   "--eval-interval", "3", "--eval-iters", "1", "--sample-tokens", "0", "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_losses_read_one_step_behind_except_at_evaluations(tmp_path, monkeypatch):
    plain_log, ahead_log = [], []
    plain = _run(tmp_path, monkeypatch, "plain", False, plain_log)
    ahead = _run(tmp_path, monkeypatch, "ahead", True, ahead_log)
    # CPU: every step read before the next is launched
    assert plain_log == [e for s in range(1, 8) for e in
                         [("launch", s), ("read", s)] + ([("eval", None)] if s in (3, 6, 7) else [])]
    # one step behind; steps 3 and 6 (evaluations) and 7 (the last) read at once, before anything else runs
    assert ahead_log == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("read", 3),
                         ("eval", None), ("launch", 4), ("launch", 5), ("read", 4), ("launch", 6), ("read", 5),
                         ("read", 6), ("eval", None), ("launch", 7), ("read", 7), ("eval", None)]
    assert [r["step"] for r in ahead] == list(range(1, 8))
    for a, b in zip(ahead, plain):
        assert (a["loss"], a["lr"], a.get("val_loss")) == (b["loss"], b["lr"], b.get("val_loss"))
