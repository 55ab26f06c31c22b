"""Checkpoints are written whole or not at all."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from mgtutor.checkpoint import load_checkpoint, save_checkpoint

fcntl = pytest.importorskip("fcntl")  # POSIX: what save_checkpoint flushes with


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


def _flushes_and_renames(monkeypatch, full_fsync: int | None) -> list[str]:
    """What save_checkpoint flushes and renames, in order; ``full_fsync``: a stand-in for
    macOS's fcntl.F_FULLFSYNC (recorded, not called), or None for a system without it."""
    events: list[str] = []
    real_fsync, real_replace, real_fcntl = os.fsync, os.replace, fcntl.fcntl

    def kind(fd: int) -> str:
        return "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"

    def fsync(fd: int) -> None:
        events.append(f"fsync {kind(fd)}")
        real_fsync(fd)

    def replace(source, target) -> None:
        events.append("replace")
        real_replace(source, target)

    def fake_fcntl(fd: int, command: int, *args):
        if command != full_fsync:
            return real_fcntl(fd, command, *args)
        events.append(f"F_FULLFSYNC {kind(fd)}")
        return 0

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    if full_fsync is None:
        monkeypatch.delattr(fcntl, "F_FULLFSYNC", raising=False)
    else:
        monkeypatch.setattr(fcntl, "F_FULLFSYNC", full_fsync, raising=False)
        monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    return events


def test_the_file_is_flushed_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch
) -> None:
    events = _flushes_and_renames(monkeypatch, None)
    save_checkpoint({"epoch": 1}, tmp_path / "ckpt.pt")
    assert events == ["fsync file", "replace", "fsync folder"]


def test_on_macos_the_drive_is_asked_to_write_too(tmp_path: Path, monkeypatch) -> None:
    # F_FULLFSYNC after each fsync: the drive writes its cache (Apple's fsync(2)).
    events = _flushes_and_renames(monkeypatch, -12345)
    save_checkpoint({"epoch": 1}, tmp_path / "ckpt.pt")
    assert events == ["fsync file", "F_FULLFSYNC file", "replace",
                      "fsync folder", "F_FULLFSYNC folder"]


def test_a_file_system_without_f_fullfsync_still_saves(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", -12345, raising=False)

    def refuse(fd: int, command: int, *args):
        raise OSError(errno.ENOTSUP, "not supported")

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    path = save_checkpoint({"epoch": 3}, tmp_path / "ckpt.pt")
    assert load_checkpoint(path) == {"epoch": 3}
