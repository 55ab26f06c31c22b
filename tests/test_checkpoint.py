"""Checkpoints are written whole or not at all."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from mgtutor.checkpoint import load_checkpoint, save_checkpoint


def test_round_trip(tmp_path: Path) -> None:
    state = {"weights": torch.arange(6.0).reshape(2, 3), "epoch": 4}
    path = save_checkpoint(state, tmp_path / "sub" / "ckpt.pt")
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 4 and torch.equal(loaded["weights"], state["weights"])
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path: Path) -> None:
    path = save_checkpoint({"epoch": 1}, tmp_path / "ckpt.pt")
    with pytest.raises(Exception, match="lambda|pickle"):
        save_checkpoint({"epoch": 2, "bad": lambda: None}, path)
    assert load_checkpoint(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_loading_refuses_code_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt")
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"obj": Path("x")}, unsafe)  # an arbitrary class: weights_only must refuse it
    with pytest.raises(Exception, match="weights_only"):
        load_checkpoint(unsafe)


def test_new_file_gets_the_umask_mode_and_a_replaced_one_keeps_its_mode(tmp_path: Path) -> None:
    old_umask = os.umask(0o027)
    try:
        path = save_checkpoint({"epoch": 1}, tmp_path / "ckpt.pt")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # as open() would have made it
    path.chmod(0o604)
    save_checkpoint({"epoch": 2}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o604


def test_the_folder_is_synced_after_the_rename(tmp_path: Path, monkeypatch) -> None:
    synced = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    path = save_checkpoint({"epoch": 1}, tmp_path / "ckpt.pt")
    assert synced[-1] == str(path.parent.resolve()), synced
