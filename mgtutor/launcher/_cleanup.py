"""Stopping rank processes and everything they started, and saying what was stopped.

Each rank leads a process group of its own (it calls ``os.setpgrp()`` first thing), so a
signal to the group reaches the DataLoader workers and other children it started; a child that
made its own session is found as a descendant while its rank lives. A pool's folder for the
doctor's files is named after its notebook's process, so the next pool removes it should the
notebook be killed before it closed its pool.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mgtutor.launcher._handle import RankHandle

_TERM_GRACE_S = 1.0


def signal_rank(h: RankHandle, sig: int) -> None:
    """Send ``sig`` to a rank's process group (or the rank alone, before it made its group)."""
    pid = h.process.pid
    if pid is None:
        return
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        if h.process.is_alive():  # killed before it could make its group
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    except PermissionError:
        pass


def descendants(handles: list[RankHandle]) -> list[Any]:
    """The live descendants of every rank (psutil processes)."""
    import psutil

    found = []
    for h in handles:
        try:
            found += psutil.Process(h.process.pid).children(recursive=True)
        except (psutil.Error, ValueError, TypeError):
            pass
    return found


def stop_all(
    handles: list[RankHandle], primary: RankHandle | None = None, owner: str = "this launch"
) -> str:
    """Stop every rank still running and everything it started; say what was stopped.

    SIGTERM first, SIGKILL to whatever is left a second later.

    Args:
        handles: the ranks.
        primary: the rank the error is about; the sentence leaves it out.
        owner: what the ranks belong to, for the sentence ("this launch", "this pool").

    Returns:
        A sentence for the error message ("Cleanup: stopped rank 1 (ended by SIGTERM). ...").
    """
    import psutil

    alive = [h for h in handles if h.process.pid is not None and h.process.is_alive()]
    children = descendants(handles)
    for h in alive:
        signal_rank(h, signal.SIGTERM)
    until = time.monotonic() + _TERM_GRACE_S
    while time.monotonic() < until and any(h.process.is_alive() for h in alive):
        wait([h.process.sentinel for h in alive if h.process.is_alive()], 0.05)
    notes = []
    for h in alive:
        if h is primary:
            continue
        if h.done is not None:
            notes.append(f"rank {h.rank} had finished")  # and waited to be told to exit
        else:
            how = "SIGTERM" if not h.process.is_alive() else "SIGKILL"
            notes.append(f"stopped rank {h.rank} (ended by {how})")
    for h in handles:
        signal_rank(h, signal.SIGKILL)
    for p in children:
        try:
            p.kill()
        except psutil.Error:
            pass
    for h in handles:
        h.process.join(5)
        if h.exitcode is None and not h.process.is_alive():
            h.exitcode = h.process.exitcode
    psutil.wait_procs(children, timeout=2)
    left = [h.rank for h in handles if h.process.is_alive()]
    left_children = [p.pid for p in children if _still_running(p)]
    for h in handles:
        if h is primary or h in alive:
            continue
        if h.error is not None:
            notes.append(failed_note(h, primary))
        elif h.done is not None:
            notes.append(f"rank {h.rank} had finished")
    stopped = "Cleanup: " + "; ".join(notes) + "." if notes else ""
    if left or left_children:
        return f"{stopped} Still running despite SIGKILL: ranks {left}, pids {left_children}."
    return f"{stopped} No process of {owner} is left running.".lstrip()


def stop_leftovers(handles: list[RankHandle]) -> None:
    """After the ranks exited: end processes they started and left behind, and say so.

    A rank's children stay in its process group after the rank exits (they are re-parented,
    so only the group still finds them); a child that made its own session was reported by the
    rank at the end of each call. Each is killed, and the message names only those that really
    were running and what became of them.
    """
    import psutil

    pids: set[int] = set()
    for h in handles:
        if h.process.pid is not None:
            pids.update(p for p in group_members(h.process.pid) if p != h.process.pid)
    pids.update(p.pid for p in descendants(handles))
    reported: dict[int, float] = {}
    for h in handles:
        reported.update(h.children)
    pids.update(reported)
    procs = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            if pid in reported and abs(proc.create_time() - reported[pid]) > 0.01:
                continue  # that pid was reused by an unrelated process
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            pass
    if not procs:
        return
    _, alive = psutil.wait_procs(procs, timeout=2)
    stopped = [p.pid for p in procs if p not in alive]
    message = "mgtutor: the ranks returned but left processes running"
    if stopped:
        message += f"; stopped them (SIGKILL): pids {', '.join(map(str, stopped))}"
    if alive:
        message += f"; still running despite SIGKILL: pids {', '.join(str(p.pid) for p in alive)}"
    print(message + ".", file=sys.stderr, flush=True)


def still_busy(h: RankHandle, now: float, idle_s: float) -> bool:
    """Whether an exiting rank's process ran or wanted to run within the last ``idle_s``.

    A process that is still shutting down (slowly, on a machine with more runnable processes
    than cores) keeps using CPU or waits for a core; one held open by a thread blocked on a join
    or a sleep does neither.
    """
    import psutil

    try:
        process = psutil.Process(h.process.pid)
        times = process.cpu_times()
        status = process.status()
    except psutil.NoSuchProcess:
        return True  # it has ended; its exit code is on the way
    except psutil.Error:
        return False
    if status == psutil.STATUS_ZOMBIE:
        # Ended, not yet reaped: a forkserver rank's exit code comes through the server,
        # which can take seconds on a loaded machine.
        return True
    runnable = status == psutil.STATUS_RUNNING
    used = times.user + times.system
    if h.exit_cpu is None or used > h.exit_cpu[0] or runnable:
        h.exit_cpu = (used, now)
        return True
    return now - h.exit_cpu[1] < idle_s


def group_members(pgid: int | None) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (each rank leads its own group)."""
    if pgid is None:
        return []
    import psutil

    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (OSError, psutil.Error):
            continue
    return members


def _still_running(process: Any) -> bool:
    import psutil

    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def failed_note(h: RankHandle, primary: RankHandle | None) -> str:
    """What the cleanup sentence says of a rank that had failed before it was stopped.

    Failing after the rank the error is about, it most often failed because of it (gloo's
    "Connection closed by peer" when that rank's process ended): it is said to be a consequence.
    Failing with the primary's own error (both ranks ran into the same bug), it failed on its own.
    """
    error = h.error
    assert error is not None
    said = f"{error.exc_type}: {_first_line(error.message)}"
    after = primary is not None and (h.failed_at or 0.0) > (primary.failed_at or 0.0)
    cause = getattr(primary, "error", None)
    same = cause is not None and f"{cause.exc_type}: {_first_line(cause.message)}" == said
    how = ""
    if after and primary is not None:  # after implies it; said again for the type checker
        how = (
            "then failed the same way"
            if same
            else (f"then failed, a consequence of rank {primary.rank}'s failure")
        )
    return f"rank {h.rank} {how or 'had already failed'} ({said})"


def _first_line(text: str) -> str:
    """The message's first sentence (gloo adds advice and an emoji after it), at most 120 chars."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    sentence = re.match(r"(.*?[.!?])(?=\s)", line)
    line = sentence.group(1) if sentence else line
    return line if len(line) <= 120 else line[:117] + "..."


# A rank told to exit gets this long before it is stopped (a non-daemon thread or a DataLoader
# worker can keep its process alive after fn returned). Past it, a process that is still using
# CPU (interpreter shutdown on a loaded machine, an atexit handler) gets more time, up to the
# cap, and is stopped once it has used none for _EXIT_IDLE_S.
_EXIT_GRACE_S = 5.0
_EXIT_IDLE_S = 2.0
_EXIT_GRACE_MAX_S = 60.0


def stop_lingering(handles: list[RankHandle]) -> None:
    """Stop a rank that was asked to exit but did not; say why that happens."""
    now = time.monotonic()
    for h in handles:
        if h.exitcode is not None or h.exit_asked_at is None:
            continue
        waited = now - h.exit_asked_at
        busy = waited < _EXIT_GRACE_MAX_S and still_busy(h, now, _EXIT_IDLE_S)
        if waited < _EXIT_GRACE_S or busy:
            continue
        members = group_members(h.process.pid)
        signal_rank(h, signal.SIGKILL)
        h.process.join(2)
        h.exitcode = h.process.exitcode
        h.lingered = True
        others = len([p for p in members if p != h.process.pid])
        extra = f" and {others} process(es) it had started" if others else ""
        print(
            f"mgtutor: rank {h.rank} returned, but its process was still running "
            f"{waited:.0f} s later (a non-daemon thread, or a DataLoader or other "
            f"child process that was not shut down); it was stopped{extra}. Its result is "
            f"kept. End threads (daemon=True, or join them) and child processes before fn "
            f"returns.",
            file=sys.stderr,
            flush=True,
        )


_DUMP_FOLDER_PREFIX = "mgtutor-fr-"


def make_dump_folder() -> str:
    """A new folder for a pool's doctor files, named after this process, whose pool removes it.

    A notebook killed before it closed its pool cannot remove its folder; the process id in
    the name lets the next pool of any notebook find it (:func:`remove_stale_dump_folders`).
    """
    import tempfile

    return tempfile.mkdtemp(prefix=f"{_DUMP_FOLDER_PREFIX}{os.getpid()}-")


def remove_stale_dump_folders(where: str | None = None) -> list[str]:
    """Remove the doctor folders left by notebook processes that no longer run; return them.

    Only this user's folders named ``mgtutor-fr-PID-...`` whose process ``PID`` has ended are
    removed; a folder of a running process, or of another user, is left alone.
    """
    import shutil
    import tempfile

    removed = []
    with os.scandir(where or tempfile.gettempdir()) as entries:
        for entry in entries:
            pid_text = entry.name.removeprefix(_DUMP_FOLDER_PREFIX).partition("-")[0]
            if entry.name == pid_text or not pid_text.isdigit() or _pid_runs(int(pid_text)):
                continue
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
            except OSError:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
