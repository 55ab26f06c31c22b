"""What a rank leaves running: its live descendants, listed after each call.

The notebook ends what fn left behind (a DataLoader's workers, a subprocess) from this list,
taken inside the rank while it still lives (:mod:`mgtutor.launcher._cleanup` does the ending).
"""

from __future__ import annotations

import os

__all__ = ["live_children", "proc_children"]


def live_children() -> list[tuple[int, float]]:
    """This rank's live descendants (pid, start time), so the parent can end what fn left.

    Taken while the rank still lives: once it exits, a child that made its own session can no
    longer be found from the parent. Taken after every call, so it must be cheap: a rank
    without children (most calls) finds out in one ``waitid`` call (a few microseconds);
    otherwise, on Linux, the kernel lists each thread's children in ``/proc``; psutil's way
    reads every process on the machine (15 ms on a busy one), too slow for every call.
    """
    if not _may_have_children():
        return []
    try:
        import psutil

        pids = proc_children(os.getpid())
        if pids is None:
            return [(p.pid, p.create_time()) for p in psutil.Process().children(recursive=True)]
        found = []
        for pid in pids:
            try:
                found.append((pid, psutil.Process(pid).create_time()))
            except psutil.Error:
                pass
        return found
    except Exception:
        return []


def _may_have_children() -> bool:
    """False when this process has no child at all (``waitid`` says ECHILD; nothing is reaped)."""
    if not hasattr(os, "waitid"):
        return True
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except OSError:
        pass
    return True


def proc_children(root: int) -> list[int] | None:
    """Descendants of ``root`` from ``/proc/PID/task/TID/children``; None where it is missing."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY)
                try:
                    kids = [int(k) for k in os.read(fd, 65536).split()]
                finally:
                    os.close(fd)
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found
