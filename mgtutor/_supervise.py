"""The parent's watch over running workers: relay output, notice faults, clean up.

One loop in the calling thread waits on every worker's pipes and process handle at once. It
prints each complete line a worker wrote as ``[rank r] ...`` (so lines from two ranks never mix,
and output reaches the cell even under nbval, where ipykernel does not forward child output),
passes progress reports to the bars, and collects results. When a rank fails, the launch runs
past its timeout, or the cell is interrupted, it stops every rank (SIGTERM, then SIGKILL after a
second), including processes the ranks started themselves, and says what it stopped.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from mgtutor.errors import WorkerError, WorkerTimeout
from mgtutor.progress import ProgressBoard

_POLL_S = 0.1
_TERM_GRACE_S = 1.0
_DRAIN_GRACE_S = 1.0
_STACK_WAIT_S = 2.0
_MAX_FRAMES = 16
# A rank that returned gets this long to exit before it is stopped (a non-daemon thread or a
# DataLoader worker can keep its process alive after fn returned). Past it, a process that is
# still using CPU (interpreter shutdown on a loaded machine, an atexit handler) gets more time,
# up to the cap, and is stopped once it has used none for _EXIT_IDLE_S.
_EXIT_GRACE_S = 5.0
_EXIT_IDLE_S = 2.0
_EXIT_GRACE_MAX_S = 60.0
# Lines drawn with a carriage return (tqdm) are shown at most this often per rank and stream.
_REDRAW_S = 0.5

_SIGNAL_HINTS = {
    "SIGKILL": (
        " SIGKILL is what the Linux out-of-memory killer sends: if nobody killed it by hand, the "
        "rank probably ran out of memory (check `dmesg`, or lower the batch size)."
    ),
    "SIGSEGV": " A crash in native code (a C++/CUDA extension, or memory corruption).",
    "SIGABRT": (
        " SIGABRT usually comes from native code giving up: on GPUs, most often NCCL's watchdog "
        "ending the process after a collective timed out or another rank failed (look for "
        "'Watchdog caught collective operation timeout' above). Set TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
        "to have each rank dump its last collectives (torch's Flight Recorder) and read the "
        "dumps with torchfrtrace."
    ),
}


@dataclass
class RankHandle:
    """The parent's view of one worker process."""

    rank: int
    process: BaseProcess
    conn: Connection
    pipes: dict[str, Connection]
    partial: dict[str, bytes] = field(default_factory=dict)
    diag: bytearray = field(default_factory=bytearray)
    main_ident: int | None = None
    started: bool = False
    done: tuple[bytes, dict[str, Any]] | None = None
    done_at: float | None = None
    exit_cpu: tuple[float, float] | None = None  # (CPU seconds, when they last grew)
    lingered: bool = False
    redrawn: dict[str, str] = field(default_factory=dict)
    redrawn_at: dict[str, float] = field(default_factory=dict)
    error: tuple[Any, ...] | None = None
    failed_at: float | None = None
    exitcode: int | None = None
    conn_open: bool = True
    closed: bool = False

    def __post_init__(self) -> None:
        self.open_pipes = set(self.pipes)


class Supervisor:
    """Watches the ranks of one launch until they all finish, or stops them all."""

    def __init__(
        self, board: ProgressBoard, timeout: float | None, start_timeout: float | None = 300.0
    ) -> None:
        self.handles: list[RankHandle] = []
        self.board = board
        self.timeout = timeout
        self.start_timeout = start_timeout

    def add(self, handle: RankHandle) -> None:
        """Watch one more started rank."""
        self.handles.append(handle)

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> list[RankHandle]:
        """Relay and watch until every rank returned; raise WorkerError on the first fault.

        ``timeout`` counts from the moment every rank has started fn, so a slow start (torch's
        import on a busy machine) does not eat into it; ``start_timeout`` limits the start.
        Either may be None: no limit.
        """
        now = time.monotonic()
        start_deadline = None if self.start_timeout is None else now + self.start_timeout
        deadline: float | None = None
        all_started = False
        try:
            while True:
                self._pump(_POLL_S)
                self._reap()
                if any(h.failed_at is not None for h in self.handles):
                    self._raise_failure()
                self._stop_lingering()
                if all(h.done is not None and h.exitcode is not None for h in self.handles):
                    self._drain(_DRAIN_GRACE_S)
                    self._stop_leftovers()
                    self.board.finish(None)
                    return self.handles
                now = time.monotonic()
                if not all_started and all(h.started for h in self.handles):
                    all_started = True
                    deadline = None if self.timeout is None else now + self.timeout
                if deadline is not None and now > deadline:
                    self._raise_timeout()
                if not all_started and start_deadline is not None and now > start_deadline:
                    self._raise_timeout(starting=True)
        except KeyboardInterrupt:
            cleanup = self._stop_all()
            self._drain(0.2)
            print(f"Interrupted. {cleanup}", file=sys.stderr, flush=True)
            self.board.finish(-1)
            raise

    def _stop_lingering(self) -> None:
        """Stop a rank whose fn returned but whose process did not exit; keep its result."""
        now = time.monotonic()
        for h in self.handles:
            if h.done is None or h.exitcode is not None or h.done_at is None:
                continue
            waited = now - h.done_at
            if waited < _EXIT_GRACE_S or (waited < _EXIT_GRACE_MAX_S and _still_busy(h, now)):
                continue
            members = _group_members(h.process.pid)
            self._signal_rank(h, signal.SIGKILL)
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

    def _watched(self) -> dict[Any, tuple[RankHandle, str]]:
        watched: dict[Any, tuple[RankHandle, str]] = {}
        for h in self.handles:
            if h.closed:
                continue
            if h.conn_open:
                watched[h.conn] = (h, "conn")
            for name in h.open_pipes:
                watched[h.pipes[name]] = (h, name)
            if h.exitcode is None:
                watched[h.process.sentinel] = (h, "exit")
        return watched

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for anything from the ranks and handle it; True if any came."""
        watched = self._watched()
        if not watched:
            time.sleep(timeout)
            return False
        ready = wait(list(watched), timeout)
        for obj in ready:
            handle, what = watched[obj]
            if what == "conn":
                self._receive(handle)
            elif what != "exit":
                self._read_pipe(handle, what)
        sys.stdout.flush()
        sys.stderr.flush()
        return bool(ready)

    def _read_pipe(self, h: RankHandle, name: str) -> None:
        try:
            data = os.read(h.pipes[name].fileno(), 65536)
        except OSError:
            data = b""
        if name == "diag":
            if data:
                h.diag += data
            else:
                h.open_pipes.discard(name)
            return
        buffered = h.partial.get(name, b"") + data
        *lines, rest = buffered.split(b"\n")
        if not data:  # end of file: what is left is a last line without a newline
            lines, rest = ([*lines, rest] if rest else lines), b""
            h.open_pipes.discard(name)
        target = sys.stdout if name == "stdout" else sys.stderr
        for line in lines:
            text = _as_drawn(line)
            if h.redrawn.pop(name, None) == text:
                continue  # its last drawing is already on screen
            target.write(f"[rank {h.rank}] {text}\n")
        if b"\r" in rest:
            # A line redrawn in place (tqdm): show what a terminal shows now, at most every
            # _REDRAW_S, instead of holding it back until the next newline.
            drawn = rest.rstrip(b"\r")
            if b"\r" in drawn:
                rest = rest[drawn.rindex(b"\r") :]  # what came before is drawn over
            text = _as_drawn(rest)
            now = time.monotonic()
            due = now - h.redrawn_at.get(name, 0.0) >= _REDRAW_S
            if text and due and text != h.redrawn.get(name):
                target.write(f"[rank {h.rank}] {text}\n")
                h.redrawn[name] = text
                h.redrawn_at[name] = now
        h.partial[name] = rest

    def _receive(self, h: RankHandle) -> None:
        try:
            message = h.conn.recv()
        except (EOFError, OSError):
            h.conn_open = False
            return
        kind, *body = message
        if kind == "hello":
            h.main_ident = body[1]
        elif kind == "started":
            h.started = True
        elif kind == "progress":
            self.board.update(h.rank, *body)
        elif kind == "done":
            h.done = (body[0], body[1])
            h.done_at = time.monotonic()
        elif kind == "error":
            h.error = tuple(body)
            h.failed_at = body[5]

    def _reap(self) -> None:
        for h in self.handles:
            if h.exitcode is not None or h.process.is_alive():
                continue
            h.process.join(0)
            h.exitcode = h.process.exitcode
            while h.conn_open and self._poll(h.conn):
                self._receive(h)
            if h.failed_at is None and (h.exitcode != 0 or h.done is None) and not h.lingered:
                h.failed_at = time.perf_counter()

    @staticmethod
    def _poll(conn: Connection) -> bool:
        try:
            return conn.poll(0)
        except (EOFError, OSError):
            return False

    # --- faults -----------------------------------------------------------------------------

    def _raise_failure(self) -> None:
        # Let near-simultaneous reports arrive, then blame the rank that failed first: when one
        # rank dies, its peers often fail a moment later with "connection closed by peer".
        settle_until = time.monotonic() + 0.2
        while time.monotonic() < settle_until and self._pump(0.05):
            self._reap()
        self._reap()
        failed = [h for h in self.handles if h.failed_at is not None]
        # A rank killed by a signal (the out-of-memory killer, a crash) is the cause of what its
        # peers report next ("Connection closed by peer"), even when their report arrives
        # before the parent notices the death: blame it first.
        killed = [h for h in failed if h.error is None and (h.exitcode or 0) < 0]
        first = min(killed or failed, key=lambda h: h.failed_at or 0.0)
        cleanup = self._stop_all(primary=first)
        self._drain(_DRAIN_GRACE_S)
        self.board.finish(first.rank)
        raise self._describe(first, cleanup)

    def _describe(self, h: RankHandle, cleanup: str) -> WorkerError:
        if h.error is not None:
            exc_type, message, tb, original_blob, context, _ = h.error
            original = None
            if original_blob is not None:
                try:
                    import cloudpickle

                    original = cloudpickle.loads(original_blob)
                except Exception:
                    original = None
            if context == "raised":
                summary = f"rank {h.rank} raised {exc_type}: {message}"
            else:
                summary = f"rank {h.rank} {context}: {exc_type}: {message}"
            return WorkerError(
                summary,
                rank=h.rank,
                exc_type=exc_type,
                exc_message=message,
                worker_traceback=tb,
                exitcode=h.exitcode,
                cleanup=cleanup,
                original=original,
            )
        code = h.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            summary = (
                f"rank {h.rank} was killed by signal {name} ({-code}).{_SIGNAL_HINTS.get(name, '')}"
            )
            return WorkerError(
                summary, rank=h.rank, exitcode=code, signal_name=name, cleanup=cleanup
            )
        if code == 0:
            summary = f"rank {h.rank} exited without returning a result (its process ended early)."
        else:
            summary = (
                f"rank {h.rank} exited with code {code} before returning a result "
                f"(os._exit, or a failure while the worker started; its last output is above)."
            )
        return WorkerError(summary, rank=h.rank, exitcode=code, cleanup=cleanup)

    def _raise_timeout(self, starting: bool = False) -> None:
        running = [h for h in self.handles if h.process.is_alive() and h.done is None]
        for h in running:
            if h.main_ident is None:
                continue  # no "hello" yet: its stack-dump handler may not be installed
            try:
                os.kill(h.process.pid, signal.SIGUSR1)  # faulthandler dumps the stack
            except ProcessLookupError:
                pass
        self._collect_stacks(running)
        stacks = {h.rank: _format_stack(bytes(h.diag), h.main_ident) for h in running}
        cleanup = self._stop_all()
        self._drain(_DRAIN_GRACE_S)
        self.board.finish(running[0].rank if running else -1)
        names = ", ".join(str(h.rank) for h in running) or "none"
        if starting:
            waiting = ", ".join(str(h.rank) for h in self.handles if not h.started)
            summary = (
                f"Ranks {waiting} had not started fn after start_timeout={self.start_timeout:g} "
                f"s (starting Python, importing, unpickling fn and its arguments); every rank "
                f"was stopped. The stacks below show where they were. On a slow or busy "
                f"machine, or with torch on a network file system, pass a larger "
                f"start_timeout (or None for no limit)."
            )
        else:
            summary = (
                f"fn ran past its timeout of {self.timeout:g} s; ranks still running: {names}. A "
                f"rank that waits in a collective (all_reduce, barrier, ...) that another rank "
                f"never calls waits until it is stopped: look at the stacks below."
            )
        raise WorkerTimeout(
            summary,
            running=[h.rank for h in running],
            stacks=stacks,
            cleanup=cleanup,
        )

    def _collect_stacks(self, running: list[RankHandle]) -> None:
        until = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < until:
            before = [len(h.diag) for h in running]
            self._pump(0.3)
            grew = any(len(h.diag) != n for h, n in zip(running, before))
            if all(h.diag for h in running) and not grew:
                return

    # --- cleanup ----------------------------------------------------------------------------

    def _descendants(self) -> list[Any]:
        import psutil

        found = []
        for h in self.handles:
            try:
                found += psutil.Process(h.process.pid).children(recursive=True)
            except psutil.Error:
                pass
        return found

    def _signal_rank(self, h: RankHandle, sig: int) -> None:
        pid = h.process.pid
        if pid is None:
            return
        try:
            os.killpg(pid, sig)  # the rank made its own process group at start
        except ProcessLookupError:
            if h.process.is_alive():  # killed before it could make its group
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        except PermissionError:
            pass

    def _stop_all(self, primary: RankHandle | None = None) -> str:
        """Stop every rank still running and everything it started; say what was stopped."""
        import psutil

        alive = [h for h in self.handles if h.process.pid is not None and h.process.is_alive()]
        descendants = self._descendants()
        for h in alive:
            self._signal_rank(h, signal.SIGTERM)
        until = time.monotonic() + _TERM_GRACE_S
        while time.monotonic() < until and any(h.process.is_alive() for h in alive):
            wait([h.process.sentinel for h in alive if h.process.is_alive()], 0.05)
        notes = []
        for h in alive:
            if h is not primary:
                how = "SIGTERM" if not h.process.is_alive() else "SIGKILL"
                notes.append(f"stopped rank {h.rank} (ended by {how})")
        for h in self.handles:
            self._signal_rank(h, signal.SIGKILL)
        for p in descendants:
            try:
                p.kill()
            except psutil.Error:
                pass
        for h in self.handles:
            h.process.join(5)
            if h.exitcode is None and not h.process.is_alive():
                h.exitcode = h.process.exitcode
        psutil.wait_procs(descendants, timeout=2)
        left = [h.rank for h in self.handles if h.process.is_alive()]
        left_children = [p.pid for p in descendants if _still_running(p)]
        for h in self.handles:
            if h is primary or h in alive:
                continue
            if h.error is not None and h.failed_at is not None:
                notes.append(
                    f"rank {h.rank} had already failed ({h.error[0]}: {_first_line(h.error[1])})"
                )
            elif h.done is not None:
                notes.append(f"rank {h.rank} had finished")
        stopped = "Cleanup: " + "; ".join(notes) + "." if notes else ""
        if left or left_children:
            return f"{stopped} Still running despite SIGKILL: ranks {left}, pids {left_children}."
        return f"{stopped} No process of this launch is left running.".lstrip()

    def _stop_leftovers(self) -> None:
        """After success: end processes a rank started and left behind, and say what was done.

        A rank's children stay in its process group after the rank exits (they are re-parented,
        so only the group still finds them); a child that made its own session is found as a
        descendant while its rank lives. Each is killed, and the message names only those that
        really were running and what became of them.
        """
        import psutil

        pids: set[int] = set()
        for h in self.handles:
            if h.process.pid is not None:
                pids.update(p for p in _group_members(h.process.pid) if p != h.process.pid)
        pids.update(p.pid for p in self._descendants())
        reported = {}
        for h in self.handles:
            for pid, created in h.done[1].get("children", []) if h.done else []:
                reported[pid] = created
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
            message += (
                f"; still running despite SIGKILL: pids {', '.join(str(p.pid) for p in alive)}"
            )
        print(message + ".", file=sys.stderr, flush=True)

    def _drain(self, grace: float) -> None:
        """Relay what the ranks wrote before they ended, until their pipes close or ``grace``."""
        until = time.monotonic() + grace
        while time.monotonic() < until and any(h.open_pipes - {"diag"} for h in self.handles):
            self._pump(0.05)
            self._reap()

    def close(self) -> None:
        """Make sure nothing of this launch is left: kill what runs, close every pipe."""
        if any(h.process.pid is not None and h.process.is_alive() for h in self.handles):
            self._stop_all()
        for h in self.handles:
            if h.process.pid is not None:
                h.process.join(1)
            for conn in (h.conn, *h.pipes.values()):
                conn.close()
            h.closed = True
            try:
                h.process.close()
            except ValueError:
                pass


_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')


def _format_stack(dump: bytes, main_ident: int | None) -> str:
    """Pick the main thread out of a faulthandler dump and add each frame's source line."""
    text = dump.decode("utf-8", "replace")
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    chosen = blocks
    if main_ident is not None:
        mark = f"0x{main_ident:016x}"
        chosen = [b for b in blocks if mark in b.splitlines()[0]] or blocks
    frames = []
    for block in chosen:
        for line in block.splitlines()[1:]:
            frame = _FRAME.match(line)
            if frame is None or frame["file"].startswith("<frozen "):
                continue
            text = f'  File "{frame["file"]}", line {frame["line"]}, in {frame["func"]}'
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if frame["func"] == "_worker_entry" and frames:
                break  # below fn are mgtutor's and multiprocessing's start-up frames
            frames.append(f"{text}\n    {source}" if source else text)
            if frame["func"] == "_worker_entry":
                break  # still starting up: mgtutor's own line says what it was doing
    if len(frames) > _MAX_FRAMES:
        # Keep the innermost frames (what it waits in) and the outermost (the user's fn).
        hidden = len(frames) - _MAX_FRAMES
        frames = [*frames[:6], f"  ... {hidden} frames omitted ...", *frames[-(_MAX_FRAMES - 6) :]]
    return "\n".join(frames)


def _as_drawn(line: bytes) -> str:
    """What a terminal shows for ``line``: the text after its last carriage return."""
    segments = [part for part in line.split(b"\r") if part]
    return segments[-1].decode("utf-8", "replace") if segments else ""


def _still_busy(h: RankHandle, now: float) -> bool:
    """Whether a returned rank's process ran or wanted to run within the last _EXIT_IDLE_S s.

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
    return now - h.exit_cpu[1] < _EXIT_IDLE_S


def _group_members(pgid: int | None) -> list[int]:
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


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 120 else line[:117] + "..."
