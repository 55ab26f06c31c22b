"""Checkpoints that are never half-written: save to a temporary file, then rename it.

A crash (or a full disk, or an object that cannot be saved) in the middle of ``torch.save``
leaves a truncated file, which the next run's ``torch.load`` fails on or resumes from. Renaming
the finished file over the target (``os.replace``, atomic on POSIX file systems) leaves the path
holding either the old checkpoint or the complete new one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Save ``obj`` with ``torch.save`` so that ``path`` is never left half-written.

    Args:
        obj: what to save, typically a dict of state dicts and counters.
        path: the checkpoint's file name; its folder is created if missing.

    Returns:
        The path written.

    Raises:
        Whatever ``torch.save`` raised; the temporary file is removed first and an existing
        checkpoint at ``path`` is left as it was.

    Example:
        >>> if dist.get_rank() == 0:
        ...     save_checkpoint({"model": model.module.state_dict(), "epoch": 3}, "ckpt.pt")
        >>> dist.barrier()
    """
    import torch

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would have
        # given a new file, or the mode of the checkpoint it replaces.
        os.fchmod(fd, _mode_for(target))
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            _flush(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise
    _fsync_directory(target.parent)
    return target


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _flush(fd: int) -> None:
    # os.fsync hands the bytes to the drive. On macOS the drive may keep them in its cache,
    # and only fcntl's F_FULLFSYNC asks it to write them (Apple's fsync(2) man page); Python's
    # os.fsync does not use it, so it follows the fsync there.
    os.fsync(fd)
    full_fsync = getattr(fcntl, "F_FULLFSYNC", None)
    if full_fsync is not None:
        try:
            fcntl.fcntl(fd, full_fsync)
        except OSError:
            pass  # a file system without it (some network ones): fsync is all there is


def _fsync_directory(folder: Path) -> None:
    # The rename lives in the folder's entry list: without this a power cut right after
    # save_checkpoint returned can still bring back the old file (or none) on some file systems.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # no directory handles on this platform
    try:
        _flush(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself still happened
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` (tensors and plain containers only).

    Uses ``torch.load(..., weights_only=True)``, which refuses to run code stored in the file.

    Args:
        path: the checkpoint file.
        map_location: where tensors go: "cpu", or this rank's device (``f"cuda:{local_rank}"``);
            without it, tensors saved from ``cuda:0`` would all land on GPU 0.

    Returns:
        The saved object.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
    """
    import torch

    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; save one with save_checkpoint first")
    return torch.load(path, map_location=map_location, weights_only=True)
