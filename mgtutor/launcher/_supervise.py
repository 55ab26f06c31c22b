"""The notebook's watch over its ranks: wait for their answers, notice faults, stop them.

One loop in the calling thread waits on every rank's message pipe, output pipes and process
handle at once (:mod:`._relay` prints the output as it comes). A call ends when every
rank it went to has answered and its output has all been relayed. When a rank fails, the call
runs past its timeout, or the cell is interrupted, the :class:`Supervisor` stops what must stop
(:mod:`mgtutor.launcher._cleanup`) and raises an error that says what happened and what was stopped.

A pool (``keep=True``) tries to keep its ranks: when a rank raises and the others finish the
call, the ranks stay; when the others do not finish (they wait in a collective the failed rank
will never join), or a rank dies or times out, every rank is stopped and the pool starts new
ones on its next call. A launch (``keep=False``) stops every rank at the first fault.
"""

from __future__ import annotations

import linecache
import os
import re
import select
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from mgtutor.errors import WorkerError, WorkerTimeout
from mgtutor.launcher import _cleanup
from mgtutor.launcher._messages import Done, Failed, Hello, Progress, Ready
from mgtutor.launcher._relay import RankOutput
from mgtutor.measure.progress import ProgressBoard

_POLL_S = 0.1
_DRAIN_GRACE_S = 1.0
_STACK_WAIT_S = 2.0
_MAX_FRAMES = 16
# After one rank of a pool raised, the others get this long to end the same call before the
# pool concludes they wait for it in a collective and stops every rank.
_PEER_GRACE_S = 3.0
# After Ctrl+C, a pool's ranks get this long to stop fn (KeyboardInterrupt in each) before
# they are stopped.
_INTERRUPT_GRACE_S = 3.0
# A rank told to exit gets this long before it is stopped (a non-daemon thread or a DataLoader
# worker can keep its process alive after fn returned). Past it, a process that is still using
# CPU (interpreter shutdown on a loaded machine, an atexit handler) gets more time, up to the
# cap, and is stopped once it has used none for _EXIT_IDLE_S.
_EXIT_GRACE_S = 5.0
_EXIT_IDLE_S = 2.0
_EXIT_GRACE_MAX_S = 60.0

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

# torch's message when a collective or a rank query runs before init_process_group (torch 2.4
# to 2.14, distributed_c10d._get_default_group).
_NO_GROUP = "Default process group has not been initialized"
_NO_GROUP_HINT = (
    " This rank used torch.distributed before joining a process group: call mgtutor.setup() "
    '(or dist.init_process_group("gloo")) at the start of fn, before any collective or '
    "get_rank()."
)

_GLOO_ABORT_HINT = (
    " On gloo, SIGABRT is gloo giving up: it ends a rank that receives more bytes than its "
    "tensor holds ('Received data size doesn't match expected size' above), when the ranks "
    "passed tensors of different sizes to the same collective."
)


@dataclass
class RankHandle:
    """The notebook's view of one rank process."""

    rank: int
    process: BaseProcess
    conn: Connection
    output: RankOutput
    main_ident: int | None = None
    ready: bool = False
    # The call this rank is in, and how far it got.
    call: int = 0
    started: bool = False
    done: Done | None = None
    error: Failed | None = None
    failed_at: float | None = None
    # Processes fn started, as the rank reported them (pid: start time).
    children: dict[int, float] = field(default_factory=dict)
    exit_asked_at: float | None = None
    exit_cpu: tuple[float, float] | None = None  # (CPU seconds, when they last grew)
    lingered: bool = False
    exitcode: int | None = None
    conn_open: bool = True
    closed: bool = False
    # Shared with the rank: [the call whose fn started, when] (see RankSpec.started).
    started_slot: Any = None

    def begin(self, call: int) -> None:
        """Forget the last call's answer: ``call`` has been sent."""
        self.call, self.started = call, False
        self.done, self.error, self.failed_at = None, None, None

    def check_started(self) -> bool:
        """True once fn of this call has started (the rank says so in the shared slot)."""
        if not self.started and self.call and self.started_slot is not None:
            self.started = int(self.started_slot[0]) == self.call
        return self.started

    @property
    def answered(self) -> bool:
        """True when the rank ended its call, one way or the other."""
        return self.done is not None or self.failed_at is not None


@dataclass(frozen=True)
class Wording:
    """How a supervisor's errors name what ran and whose ranks were stopped.

    Attributes:
        work: what ran, at the start of a sentence ("fn"; "The %%ddp cell").
        owner: whose processes are gone ("No process of this launch is left running").
        note: added to every error that stopped the ranks ("" for a launch).
    """

    work: str = "fn"
    owner: str = "this launch"
    note: str = ""


class Supervisor:
    """Watches the ranks of one pool (or one launch) and stops them when it must.

    Args:
        wording: how its errors name what ran (a launch's by default).
    """

    def __init__(self, wording: Wording | None = None) -> None:
        self.handles: list[RankHandle] = []
        self.board: ProgressBoard | None = None
        self.wording = wording or Wording()
        self.stopped = False  # the ranks were stopped after a fault
        # rank -> the file its doctor responder writes its record to (mgtutor.doctor).
        self.dump_paths: dict[int, str] = {}
        # The selector of _pump, kept while the set it watches stays the same (building one
        # registers every pipe again at every wait).
        self._selector: selectors.BaseSelector | None = None
        self._selected: set[Any] = set()
        self._printed = False  # a Progress message printed a line since the last flush

    def add(self, handle: RankHandle) -> None:
        """Watch one more started rank."""
        self.handles.append(handle)

    def send(self, h: RankHandle, message: Any) -> bool:
        """Send a message to a rank; False when its pipe is closed (the rank has gone)."""
        try:
            h.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def send_pickled(self, h: RankHandle, message: bytes) -> bool:
        """:meth:`send` for a message pickled once for every rank (``ForkingPickler.dumps``)."""
        try:
            h.conn.send_bytes(message)
            return True
        except (OSError, ValueError):
            return False

    def alive(self) -> bool:
        """True while every rank process runs and none was stopped."""
        if self.stopped or any(h.process.pid is None for h in self.handles):
            return False
        try:  # one look at every rank's exit, not a wait each (pool.run asks at every call)
            return not _ended([h.process.sentinel for h in self.handles])
        except ValueError:  # a process already closed
            return False

    # --- waiting --------------------------------------------------------------------------

    def wait_ready(self, start_timeout: float | None) -> None:
        """Wait until every rank has started and joined the process group.

        Raises:
            WorkerError: a rank failed on the way.
            WorkerTimeout: ``start_timeout`` passed.
        """
        deadline = None if start_timeout is None else time.monotonic() + start_timeout
        try:
            while not all(h.ready for h in self.handles):
                self._pump(_POLL_S)
                self._reap()
                if any(h.failed_at is not None for h in self.handles):
                    self._raise_failure(self.handles, keep=False)
                if deadline is not None and time.monotonic() > deadline:
                    self._raise_timeout(self.handles, None, start_timeout, starting=True)
        except KeyboardInterrupt:
            self._stop_on_interrupt()
            raise

    def run_call(
        self,
        call: int,
        targets: list[RankHandle],
        board: ProgressBoard,
        timeout: float | None,
        start_timeout: float | None,
        keep: bool,
    ) -> None:
        """Wait until every rank in ``targets`` answered ``call`` (already sent to them).

        ``timeout`` counts from the moment every target has started fn, so a slow start
        (torch's import on a busy machine) does not eat into it; ``start_timeout`` limits the
        start. Either may be None: no limit.

        Raises:
            WorkerError: a rank failed (see the module docstring for what is stopped).
            WorkerTimeout: a limit passed; every rank was stopped.
            KeyboardInterrupt: the cell was interrupted.
        """
        self.board = board
        now = time.monotonic()
        start_deadline = None if start_timeout is None else now + start_timeout
        deadline: float | None = None
        all_started = False
        try:
            while True:
                self._pump(_POLL_S)
                self._reap()
                if any(h.failed_at is not None for h in self.handles):
                    self._raise_failure(targets, keep)
                if all(h.done is not None and h.output.relayed(call) for h in targets):
                    board.finish(None)
                    return
                now = time.monotonic()
                if not all_started and all(h.check_started() for h in targets):
                    all_started = True
                    deadline = None if timeout is None else now + timeout
                if deadline is not None and now > deadline:
                    self._raise_timeout(targets, timeout, start_timeout)
                if not all_started and start_deadline is not None and now > start_deadline:
                    self._raise_timeout(targets, timeout, start_timeout, starting=True)
        except KeyboardInterrupt:
            if keep and not self.stopped:
                self._interrupt(targets)
            else:
                self._stop_on_interrupt()
            raise

    def _watched(self) -> dict[Any, tuple[RankHandle, str]]:
        watched: dict[Any, tuple[RankHandle, str]] = {}
        for h in self.handles:
            if h.closed:
                continue
            if h.conn_open:
                watched[h.conn] = (h, "conn")
            for name in h.output.open:
                watched[h.output.pipes[name]] = (h, name)
            if h.exitcode is None:
                watched[h.process.sentinel] = (h, "exit")
        return watched

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for anything from the ranks and handle it; True if any came."""
        watched = self._watched()
        if not watched:
            time.sleep(timeout)
            return False
        ready = self._wait(watched, timeout)
        # Output first: an answer then relays the rest of its rank's output (drain), after
        # which a pipe this wait saw readable may be empty.
        for obj in sorted(ready, key=lambda o: watched[o][1] == "conn"):
            handle, what = watched[obj]
            if what == "conn":
                self._receive(handle)
            elif what != "exit":
                handle.output.read(what)
        # Only after something was printed: in a kernel, each flush waits for ipykernel's IO
        # thread, even with nothing to send.
        if any([h.output.take_written() for h in self.handles]) or self._printed:
            self._printed = False
            sys.stdout.flush()
            sys.stderr.flush()
        return bool(ready)

    def _wait(self, watched: dict[Any, tuple[RankHandle, str]], timeout: float) -> list[Any]:
        """``multiprocessing.connection.wait`` on ``watched``, with a selector kept for reuse."""
        if self._selector is None or self._selected != watched.keys():
            self._selector = _Selector()
            self._selected = set(watched)
            for obj in watched:
                self._selector.register(obj, selectors.EVENT_READ)
        return [key.fileobj for key, _ in self._selector.select(timeout)]

    def _receive(self, h: RankHandle) -> None:
        try:
            message = h.conn.recv()
        except (EOFError, OSError):
            h.conn_open = False
            return
        if isinstance(message, Progress):
            if self.board is not None:
                self.board.update(h.rank, message.step, message.total, message.desc)
                self._printed = True
        elif isinstance(message, Done) and message.call == h.call:
            h.output.drain(message.call)
            h.done = message
            h.children.update(message.record.get("children", []))
        elif isinstance(message, Failed) and message.call in (h.call, 0):
            h.output.drain(message.call)
            h.error = message
            h.failed_at = message.when
        elif isinstance(message, Hello):
            h.main_ident = message.main_ident
        elif isinstance(message, Ready):
            h.ready = True

    def _reap(self) -> None:
        running = [h for h in self.handles if h.exitcode is None]
        if not running:
            return
        # One look at every rank's exit (a forkserver rank's is_alive is a wait of its own).
        ended = _ended([h.process.sentinel for h in running])
        for h in running:
            if h.process.sentinel not in ended or h.process.is_alive():
                continue
            h.process.join(0)
            h.exitcode = h.process.exitcode
            while h.conn_open and self._poll(h.conn):
                self._receive(h)
            if h.failed_at is None and h.exit_asked_at is None and h.done is None:
                h.failed_at = time.perf_counter()  # it ended without answering

    @staticmethod
    def _poll(conn: Connection) -> bool:
        try:
            return conn.poll(0)
        except (EOFError, OSError):
            return False

    # --- faults -----------------------------------------------------------------------------

    def _diagnose(self) -> Any:
        """Ask every live rank for its record of collectives; what the doctor makes of them.

        Ranks that failed sent their record with the failure, a launch's ranks that returned
        sent it with their answer, and a rank that native code aborted wrote it as it died.
        Returns None when there is nothing to compare (no rank made a process group).
        """
        from mgtutor import doctor

        alive = {
            h.rank: h.process.pid
            for h in self.handles
            if h.process.pid is not None and h.process.is_alive() and h.rank in self.dump_paths
        }
        try:
            records: dict[int, Any] = doctor.request_dumps(alive, self.dump_paths, timeout=1.0)
        except OSError:
            records = {}
        raised = {}
        for h in self.handles:
            if h.error is not None and h.error.record is not None:
                # Taken as it failed, where it failed: the rank may be elsewhere by now.
                records[h.rank] = h.error.record
            if h.error is not None and h.error.context == "raised":
                message = (h.error.message.splitlines() or [""])[0]
                short = message if len(message) <= 120 else message[:117] + "..."
                raised[h.rank] = f"{h.error.exc_type.rsplit('.', 1)[-1]}: {short}".rstrip(": ")
            sent = h.done.record.get("flight_record") if h.done is not None else None
            if sent is not None:
                records.setdefault(h.rank, sent)  # a launch's rank that answered and exited
        dead = {r: p for r, p in self.dump_paths.items() if r not in records}
        records.update(doctor.read_final_records(dead))
        traced = {r: rec for r, rec in records.items() if rec.get("trace") is not None}
        no_group = all(not (rec.get("trace") or {}).get("entries") for rec in traced.values())
        in_call = any(rec.get("call") for rec in records.values())  # send/recv: not recorded
        if not records or (traced and no_group and not in_call):
            return None  # no collective was ever issued: nothing to say
        finished = [h.rank for h in self.handles if h.done is not None]
        try:
            return doctor.diagnose(
                records, finished=finished, raised=raised, world_size=len(self.handles)
            )
        except Exception as exc:  # the doctor must never hide the error it explains
            return doctor.Diagnosis(
                f"the doctor failed on these records ({type(exc).__name__}: {exc})",
                kind="no_recorder",
                records=records,
            )

    def _stop(self, primary: RankHandle | None = None) -> str:
        cleanup = _cleanup.stop_all(self.handles, primary, self.wording.owner)
        self.stopped = True
        return f"{cleanup} {self.wording.note}".strip()

    def _raise_failure(self, targets: list[RankHandle], keep: bool) -> None:
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
        died = [h for h in failed if h.error is None]
        killed = [h for h in died if (h.exitcode or 0) < 0]
        first = min(killed or failed, key=lambda h: h.failed_at or 0.0)
        if keep and not died:
            kept, diagnosis = self._settle_after_error(first, targets)
            if kept is not None:
                if self.board is not None:
                    self.board.finish(first.rank)
                raise self._describe(first, kept, diagnosis)
        diagnosis = self._diagnose()
        cleanup = self._stop(primary=first)
        self._drain(_DRAIN_GRACE_S)
        if self.board is not None:
            self.board.finish(first.rank)
        raise self._describe(first, cleanup, diagnosis)

    def _settle_after_error(
        self, first: RankHandle, targets: list[RankHandle]
    ) -> tuple[str | None, Any]:
        """A pool's rank raised: let the others end the call.

        Returns:
            The sentence to report (None when a rank died meanwhile: the caller stops them
            all), and the doctor's diagnosis when some ranks were stuck.
        """
        self._wait_answered(targets, _PEER_GRACE_S)
        if any(h.error is None and h.failed_at is not None for h in self.handles):
            return None, None  # one died meanwhile
        stuck = [h for h in targets if not h.answered]
        if stuck:
            diagnosis = self._diagnose()
            stacks = self._stacks(stuck)
            names = ", ".join(str(h.rank) for h in stuck)
            cleanup = self._stop(primary=first)
            self._drain(_DRAIN_GRACE_S)
            where = "".join(
                f"\nWhere rank {h.rank} was (most recent call last):\n{stacks[h.rank]}"
                for h in stuck
            )
            first.error = first.error and _with_note(
                first.error,
                f"Rank(s) {names} had not finished {_PEER_GRACE_S:g} s later: most likely they "
                f"wait in a collective rank {first.rank} will never reach.{where}",
            )
            return cleanup, diagnosis
        self._wait_relayed(targets)
        others = [h for h in targets if h is not first]
        also = [str(h.rank) for h in others if h.error is not None]
        fine = [str(h.rank) for h in others if h.done is not None]
        parts = []
        if also:
            parts.append(f"rank(s) {', '.join(also)} failed too")
        if fine:
            parts.append(f"rank(s) {', '.join(fine)} finished the call")
        said = ("; ".join(parts) + ". ") if parts else ""
        return f"{said.capitalize()}The pool's ranks are kept, with what they hold.", None

    def _describe(self, h: RankHandle, cleanup: str, diagnosis: Any = None) -> WorkerError:
        if h.error is not None:
            error = h.error
            original = None
            if error.original is not None:
                try:
                    import cloudpickle

                    original = cloudpickle.loads(error.original)
                except Exception:
                    original = None
            if error.context == "raised":
                summary = f"rank {h.rank} raised {error.exc_type}: {error.message}"
                if _NO_GROUP in error.message:
                    summary += _NO_GROUP_HINT
            else:
                summary = f"rank {h.rank} {error.context}: {error.exc_type}: {error.message}"
            return WorkerError(
                summary,
                rank=h.rank,
                exc_type=error.exc_type,
                exc_message=error.message,
                worker_traceback=error.traceback,
                exitcode=h.exitcode,
                cleanup=cleanup,
                original=original,
                diagnosis=diagnosis,
            )
        code = h.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = _SIGNAL_HINTS.get(name, "")
            from mgtutor import doctor

            records = getattr(diagnosis, "records", None) or {}
            if name == "SIGABRT" and doctor.aborted_on_gloo(records.get(h.rank)):
                hint = _GLOO_ABORT_HINT
            summary = f"rank {h.rank} was killed by signal {name} ({-code}).{hint}"
            return WorkerError(
                summary,
                rank=h.rank,
                exitcode=code,
                signal_name=name,
                cleanup=cleanup,
                diagnosis=diagnosis,
            )
        if code == 0:
            summary = f"rank {h.rank} exited without returning a result (its process ended early)."
        else:
            summary = (
                f"rank {h.rank} exited with code {code} before returning a result "
                f"(os._exit, or a failure while the worker started; its last output is above)."
            )
        return WorkerError(
            summary, rank=h.rank, exitcode=code, cleanup=cleanup, diagnosis=diagnosis
        )

    def _raise_timeout(
        self,
        targets: list[RankHandle],
        timeout: float | None,
        start_timeout: float | None,
        starting: bool = False,
    ) -> None:
        running = [h for h in targets if h.process.is_alive() and not h.answered]
        diagnosis = None if starting else self._diagnose()
        stacks = self._stacks(running)
        cleanup = self._stop()
        self._drain(_DRAIN_GRACE_S)
        if self.board is not None:
            self.board.finish(running[0].rank if running else -1)
        names = ", ".join(str(h.rank) for h in running) or "none"
        if starting:
            waiting = ", ".join(
                str(h.rank) for h in targets if not (h.check_started() or (h.ready and h.call == 0))
            )
            summary = (
                f"Ranks {waiting} had not started after start_timeout={start_timeout:g} s "
                f"(starting Python, importing, joining the group, unpickling fn and its "
                f"arguments); every rank was stopped. The stacks below show where they were. On "
                f"a slow or busy machine, or with torch on a network file system, pass a larger "
                f"start_timeout (or None for no limit)."
            )
        else:
            summary = (
                f"{self.wording.work} ran past its timeout of {timeout:g} s; ranks still "
                f"running: {names}. A rank that waits in a collective (all_reduce, barrier, "
                f"...) that another rank never calls waits until it is stopped: look at the "
                f"stacks below."
            )
        raise WorkerTimeout(
            summary,
            running=[h.rank for h in running],
            stacks=stacks,
            cleanup=cleanup,
            diagnosis=diagnosis,
        )

    def _stacks(self, ranks: list[RankHandle]) -> dict[int, str]:
        """Each rank's Python stack now, from its faulthandler (works while it is blocked)."""
        for h in ranks:
            h.output.diag.clear()
            if h.main_ident is None:
                continue  # no Hello yet: its stack-dump handler may not be installed
            try:
                os.kill(h.process.pid, signal.SIGUSR1)
            except (ProcessLookupError, TypeError):
                pass
        until = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < until:
            before = [len(h.output.diag) for h in ranks]
            self._pump(0.3)
            grew = any(len(h.output.diag) != n for h, n in zip(ranks, before))
            if all(h.output.diag for h in ranks) and not grew:
                break
        return {h.rank: _format_stack(bytes(h.output.diag), h.main_ident) for h in ranks}

    def _interrupt(self, targets: list[RankHandle]) -> None:
        """Ctrl+C in a pool: interrupt fn on every rank; stop them all if that fails."""
        busy = [h for h in targets if not h.answered]
        for h in busy:
            try:
                os.kill(h.process.pid, signal.SIGINT)
            except (ProcessLookupError, TypeError):
                pass
        try:
            self._wait_answered(targets, _INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pass  # pressed again: stop them below
        stuck = [h for h in targets if not h.answered]
        died = [h for h in self.handles if h.failed_at is not None and h.error is None]
        if stuck or died:
            names = ", ".join(str(h.rank) for h in stuck + died)
            cleanup = self._stop()
            self._drain(0.2)
            message = (
                f"Interrupted. Rank(s) {names} did not stop fn within {_INTERRUPT_GRACE_S:g} s "
                f"(native code such as a collective cannot be interrupted). {cleanup}"
            )
        else:
            self._wait_relayed(targets)
            message = "Interrupted: fn stopped on every rank; the pool's ranks are kept."
        if self.board is not None:
            self.board.finish(-1)
        print(message, file=sys.stderr, flush=True)

    def _stop_on_interrupt(self) -> None:
        cleanup = self._stop()
        self._drain(0.2)
        print(f"Interrupted. {cleanup}", file=sys.stderr, flush=True)
        if self.board is not None:
            self.board.finish(-1)

    # --- the end ----------------------------------------------------------------------------

    def _wait_answered(self, targets: list[RankHandle], seconds: float) -> None:
        """Relay and reap until every target answered its call (or ended), or ``seconds``."""
        until = time.monotonic() + seconds
        while time.monotonic() < until and not all(h.answered for h in targets):
            self._pump(0.05)
            self._reap()

    def _wait_relayed(self, targets: list[RankHandle]) -> None:
        """Relay until each target's output of its call has been relayed, or a grace."""
        until = time.monotonic() + _DRAIN_GRACE_S
        while time.monotonic() < until and not all(h.output.relayed(h.call) for h in targets):
            self._pump(0.05)

    def _drain(self, grace: float) -> None:
        """Relay what the ranks wrote before they ended, until their pipes close or ``grace``."""
        until = time.monotonic() + grace
        while time.monotonic() < until and any(h.output.open - {"diag"} for h in self.handles):
            self._pump(0.05)
            self._reap()

    def close(self, exit_message: Any) -> None:
        """End every rank: ask each to exit, stop one that does not, then close every pipe.

        A rank whose process does not end after it was asked (a non-daemon thread, a child
        process still running) is stopped after ``_EXIT_GRACE_S``, and the notebook says so;
        processes the ranks started and left behind are stopped too.
        """
        started = [h for h in self.handles if h.process.pid is not None]
        if started and not self.stopped:
            # A launch's ranks exit by themselves after answering; a pool's wait to be told.
            now = time.monotonic()
            for h in started:
                if h.exitcode is None:
                    h.exit_asked_at = h.exit_asked_at or now
                    self.send(h, exit_message)
            try:
                while any(h.exitcode is None for h in started):
                    self._pump(_POLL_S)
                    self._reap()
                    self._stop_lingering()
                self._drain(_DRAIN_GRACE_S)
                _cleanup.stop_leftovers(self.handles)
            except KeyboardInterrupt:
                self._stop_on_interrupt()
                raise
            finally:
                self._close_pipes()
            return
        if any(h.process.pid is not None and h.process.is_alive() for h in self.handles):
            self._stop()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if any(h.process.pid is not None and h.process.is_alive() for h in self.handles):
            self._stop()
        for h in self.handles:
            if h.closed:
                continue
            if h.process.pid is not None:
                h.process.join(1)
            h.conn.close()
            h.output.close()
            h.closed = True
            try:
                h.process.close()
            except ValueError:
                pass

    def _stop_lingering(self) -> None:
        """Stop a rank that was asked to exit but did not; say why that happens."""
        now = time.monotonic()
        for h in self.handles:
            if h.exitcode is not None or h.exit_asked_at is None:
                continue
            waited = now - h.exit_asked_at
            busy = waited < _EXIT_GRACE_MAX_S and _cleanup.still_busy(h, now, _EXIT_IDLE_S)
            if waited < _EXIT_GRACE_S or busy:
                continue
            members = _cleanup.group_members(h.process.pid)
            _cleanup.signal_rank(h, signal.SIGKILL)
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


_Selector = getattr(selectors, "PollSelector", selectors.SelectSelector)  # as multiprocessing


def _ended(sentinels: list[int]) -> list[int]:
    """The process sentinels that are readable now (their processes ended), without waiting."""
    if not hasattr(select, "poll"):
        return wait(sentinels, 0)
    poller = select.poll()
    for fd in sentinels:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(0)]


def _with_note(error: Failed, note: str) -> Failed:
    from dataclasses import replace

    return replace(error, traceback=f"{error.traceback.rstrip()}\n\n{note}")


_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')
# Functions below fn on a rank's stack: mgtutor's own start-up and call loop (and %%ddp's
# runner of a cell's code, below the cell).
_ENTRY_FRAMES = ("_run_source", "_measured_call", "_run_call", "rank_main")


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
            if frame["func"] in _ENTRY_FRAMES and frames:
                break  # below fn are mgtutor's and multiprocessing's start-up frames
            frames.append(f"{text}\n    {source}" if source else text)
            if frame["func"] in _ENTRY_FRAMES:
                break  # still starting up: mgtutor's own line says what it was doing
    frames.reverse()  # faulthandler lists the innermost frame first; Python's order is last
    if len(frames) > _MAX_FRAMES:
        # Keep the outermost frames (the user's fn) and the innermost (what it waits in).
        hidden = len(frames) - _MAX_FRAMES
        frames = [*frames[: _MAX_FRAMES - 6], f"  ... {hidden} frames omitted ...", *frames[-6:]]
    return "\n".join(frames)
