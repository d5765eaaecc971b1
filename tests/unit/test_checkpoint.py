import os
from pathlib import Path

import pytest
import torch

from ddrl.training import checkpoint as ckpt


class FakeModel:
    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, d):
        d = Path(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        if self.fail:
            raise OSError("disk full")
        (d / "model.safetensors").write_text("x")


def test_save_is_atomic_and_complete(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 3, FakeModel(), {"step": 3})
    assert path.name == "checkpoint-3" and (path / ckpt.COMPLETE).exists()
    assert ckpt.load_trainer_state(path)["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")]


def test_failed_write_leaves_previous_checkpoint_and_no_partial(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, FakeModel(), {"step": 1})
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, FakeModel(fail=True), {"step": 2})
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()


def test_half_written_checkpoint_is_never_loaded(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, FakeModel(), {"step": 1})
    half = tmp_path / "checkpoint-5"
    half.mkdir()
    torch.save({"step": 5}, half / "trainer_state.pt")  # killed before the COMPLETE marker
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-1"
    with pytest.raises(ValueError, match="incomplete.*interrupted"):
        ckpt.load_trainer_state(half)


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, s, FakeModel(), {"step": s}, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]


def test_unwritable_run_dir_fails_at_start(tmp_path):
    from ddrl.training.common import check_writable

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permission bits: use a path under a file instead
            target = tmp_path / "afile"
            target.write_text("x")
            with pytest.raises(ValueError, match="not writable"):
                check_writable(target / "run")
        else:
            with pytest.raises(ValueError, match="not writable"):
                check_writable(ro / "run")
    finally:
        os.chmod(ro, 0o700)
