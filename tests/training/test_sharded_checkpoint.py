"""Multi-rank checkpoint folders (fp8engine/training/sharded_checkpoint.py) in one process: a gloo group of one
rank runs the same collectives as a torchrun job. Retention, leftovers, fallback past a damaged shard, refusal
when none verifies. The 2-rank agreement runs as real processes in tests/test_train_reliability.py."""
import json

import pytest
import torch
import torch.distributed as dist

from fp8engine.training import UsageError
from fp8engine.training.checkpoint import capture_rng_state
from fp8engine.training.distributed import Layout
from fp8engine.training.sharded_checkpoint import (has_sharded, load_sharded, read_sharded_settings, save_sharded,
                                                   select_sharded, sharded_dirs)

SETTINGS = {"world_size": 1, "tp": 1, "lr": 0.1}


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Layout()
    dist.destroy_process_group()


def _model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_and_save(out, layout, steps, keep):
    """A few AdamW steps on random data, saved after each; returns the model's state_dict after each step."""
    model, opt = _model(0)
    states = {}
    for step in steps:
        model(torch.randn(9, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        save_sharded(out, layout, model, opt, {"rng": capture_rng_state(), "step": step,
                                                "settings": dict(SETTINGS)}, step, keep=keep)
    return states


def _names(out):
    return sorted(p.name for p in (out / "checkpoint").iterdir())


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_keeps_the_newest_k_and_drops_leftovers(tmp_path, group):
    """keep=3: four saves leave steps 2-4; a crashed save's folder (no checksums) and a later step's folder (a
    run a resume fell back past) are deleted by the next save, and a same-step folder is replaced."""
    _train_and_save(tmp_path, group, range(1, 5), keep=3)
    assert _names(tmp_path) == ["latest", "step_2", "step_3", "step_4"]
    sums = json.loads((tmp_path / "checkpoint" / "step_4" / "checksums.json").read_text())
    assert sorted(sums) == [".metadata", "__0_0.distcp"]
    assert [p.name for p in sharded_dirs(tmp_path)] == ["step_4", "step_3", "step_2"]
    (tmp_path / "checkpoint" / "step_9").mkdir()  # a later run's folder
    (tmp_path / "checkpoint" / "step_9" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "checkpoint" / "step_5").mkdir()  # a crashed save of step 5: replaced
    (tmp_path / "checkpoint" / "step_5" / "stale").write_bytes(b"x")
    _train_and_save(tmp_path, group, [5], keep=2)
    assert _names(tmp_path) == ["latest", "step_4", "step_5"]
    assert (tmp_path / "checkpoint" / "latest").read_text().strip() == "step_5"
    assert not (tmp_path / "checkpoint" / "step_5" / "stale").exists()


def test_resume_falls_back_past_a_damaged_shard(tmp_path, group):
    """Step 3's shard damaged: one line naming it and this rank's reason, one naming the fallback; the loaded
    model is exactly step 2's. All damaged: UsageError naming the folder."""
    states = _train_and_save(tmp_path, group, [1, 2, 3], keep=2)
    _flip_byte(tmp_path / "checkpoint" / "step_3" / "__0_0.distcp")
    assert read_sharded_settings(tmp_path, SETTINGS)["step"] == 3  # plain values still read: not checked here
    lines = []
    meta = select_sharded(tmp_path, SETTINGS, torch.device("cpu"), lines.append)
    assert meta["step"] == 2 and meta["dir"].name == "step_2"
    assert lines == [f"checkpoint at {tmp_path / 'checkpoint' / 'step_3'} is damaged (rank 0: __0_0.distcp: "
                     "CRC-32 differs from the one recorded at save time); trying the next older one",
                     f"resuming from the older checkpoint {tmp_path / 'checkpoint' / 'step_2'} (step 2) instead"]
    model, opt = _model(1)
    load_sharded(meta["dir"], group, model, opt)
    for key, value in states[2].items():
        assert torch.equal(model.state_dict()[key], value), key

    (tmp_path / "checkpoint" / "step_2" / ".metadata").write_bytes(b"")  # truncated
    lines.clear()
    with pytest.raises(UsageError, match=r"no checkpoint in .*checkpoint verifies on every rank \(all 2 damaged\)"):
        select_sharded(tmp_path, SETTINGS, torch.device("cpu"), lines.append)
    assert len(lines) == 2 and ".metadata has 0 bytes" in lines[1]
    assert has_sharded(tmp_path)


def test_settings_of_another_layout_refused(tmp_path, group):
    _train_and_save(tmp_path, group, [1], keep=2)
    with pytest.raises(UsageError, match=r"written by 1 processes with --tp 1, this run has 2 with --tp 2"):
        read_sharded_settings(tmp_path, {"world_size": 2, "tp": 2, "lr": 0.1})


def test_fsdp_settings_of_another_world_size_read(tmp_path, group):
    """FSDP2 checkpoints reshard: another world size of the same --tp reads (load_sharded reshards); another --tp,
    or a run without --fsdp on either side, is still refused in one line that says why."""
    from fp8engine.training.sharded_checkpoint import reshardable

    fsdp = {"world_size": 1, "tp": 1, "lr": 0.1, "fsdp": True}
    model, opt = _model(0)
    save_sharded(tmp_path, group, model, opt, {"rng": capture_rng_state(), "step": 1, "settings": fsdp}, 1)
    assert read_sharded_settings(tmp_path, fsdp | {"world_size": 4})["step"] == 1
    with pytest.raises(UsageError, match=r"only --fsdp runs of the same --tp reshard"):
        read_sharded_settings(tmp_path, fsdp | {"world_size": 4, "tp": 2})
    with pytest.raises(UsageError, match=r"written by 1 processes with --tp 1, this run has 4"):
        read_sharded_settings(tmp_path, fsdp | {"world_size": 4, "fsdp": False})
    assert reshardable(fsdp, fsdp | {"world_size": 8}) and not reshardable({"tp": 1}, fsdp)
