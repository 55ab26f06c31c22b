"""The notebook's watch over its ranks: wait for their answers, notice faults, stop them.

One loop in the calling thread listens to every rank at once (:class:`~._watch.RankWatch`, on
which the :class:`Supervisor` is built). A call ends when every rank it went to has answered
and its output has all been relayed. When a rank fails, the call runs past its timeout, or the
cell is interrupted, the :class:`Supervisor` stops what must stop (:mod:`._cleanup`) and raises
an error that says what happened and what was stopped (worded by :mod:`._report`).

A pool (``keep=True``) tries to keep its ranks: when a rank raises and the others finish the
call, the ranks stay; when the others do not finish (they wait in a collective the failed rank
will never join), or a rank dies or times out, every rank is stopped and the pool starts new
ones on its next call. A launch (``keep=False``) stops every rank at the first fault.

An interrupted cell (Stop, Kernel > Interrupt, Ctrl+C) is how ranks that hang are most often
stopped: ``launch`` and ``Pool.run`` have no time limit by default. So an interrupt asks the
live ranks for their records of collectives and their stacks, as a timeout does (:mod:`._report`,
:mod:`mgtutor.doctor`), for at most a few seconds, then stops what must stop, and raises
:class:`~mgtutor.errors.WorkerInterrupted`: it opens with the doctor's finding ("rank 1 never
reached all_reduce #1, which rank 0 is waiting in"), says what was stopped and where each rank
was, and shows none of mgtutor's frames. A second interrupt skips the asking and stops at once.
A pool first interrupts fn on each rank (SIGINT): ranks that stop are kept; ranks blocked in
native code (a collective) cannot be interrupted and are stopped, as a launch's always are.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from mgtutor.errors import WorkerInterrupted, WorkerTimeout
from mgtutor.launcher import _cleanup, _report
from mgtutor.launcher._handle import RankHandle
from mgtutor.launcher._report import PAUSED_HOW, Wording, ranks_named
from mgtutor.launcher._watch import POLL_S, RankWatch, ended_sentinels
from mgtutor.launcher.progress_bars import ProgressBoard

if TYPE_CHECKING:
    from mgtutor.wire.messages import Exit

_DRAIN_GRACE_S = 1.0
_STACK_WAIT_S = 2.0
# After one rank of a pool raised, the others get this long to end the same call before the
# pool concludes they wait for it in a collective and stops every rank.
_PEER_GRACE_S = 3.0
# A pool's ranks get this long to stop fn (KeyboardInterrupt in each) before they are stopped.
_INTERRUPT_GRACE_S = 3.0
_HOW = "(Stop, Kernel > Interrupt or Ctrl+C)"


class Supervisor(RankWatch):
    """Watches the ranks of one pool (or one launch) and stops them when it must.

    Args:
        wording: how its errors name what ran (a launch's by default).
    """

    def __init__(self, wording: Wording | None = None) -> None:
        super().__init__()
        self.wording = wording or Wording()
        self.stopped = False  # the ranks were stopped after a fault
        # rank -> the file its doctor responder writes its record to (mgtutor.doctor).
        self.dump_paths: dict[int, str] = {}

    def alive(self) -> bool:
        """True while every rank process runs and none was stopped."""
        if self.stopped or any(h.process.pid is None for h in self.handles):
            return False
        try:  # one look at every rank's exit, not a wait each (pool.run asks at every call)
            return not ended_sentinels([h.process.sentinel for h in self.handles])
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
                self._pump(POLL_S)
                self._reap()
                if any(h.failed_at is not None for h in self.handles):
                    self._raise_failure(self.handles, keep=False)
                if deadline is not None and time.monotonic() > deadline:
                    self._raise_timeout(self.handles, None, start_timeout, starting=True)
        except KeyboardInterrupt:
            raise self._after_interrupt(self.handles, False, "starting") from None

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
            WorkerInterrupted: the cell was interrupted (a KeyboardInterrupt); see
                the module's docstring for what is stopped.
        """
        self.board = board
        now = time.monotonic()
        start_deadline = None if start_timeout is None else now + start_timeout
        deadline: float | None = None
        all_started = False
        try:
            while True:
                self._pump(POLL_S)
                if self.maybe_ended:
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
            raise self._after_interrupt(targets, keep) from None

    # --- faults -----------------------------------------------------------------------------

    def stop(self, primary: RankHandle | None = None) -> str:
        """Stop every rank and what it started (``primary`` first); what was stopped, worded."""
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
                raise _report.describe(first, kept, diagnosis)
        diagnosis = _report.diagnose(self.handles, self.dump_paths, self.wording)
        cleanup = self.stop(primary=first)
        self.drain(_DRAIN_GRACE_S)
        if self.board is not None:
            self.board.finish(first.rank)
        raise _report.describe(first, cleanup, diagnosis)

    def _settle_after_error(
        self, first: RankHandle, targets: list[RankHandle]
    ) -> tuple[str | None, Any]:
        """A pool's rank raised: let the others end the call.

        Returns:
            The sentence to report (None when a rank died meanwhile: the caller stops them
            all), and the doctor's diagnosis when some ranks were stuck.
        """
        self.wait_answered(targets, _PEER_GRACE_S)
        if any(h.error is None and h.failed_at is not None for h in self.handles):
            return None, None  # one died meanwhile
        stuck = [h for h in targets if not h.answered]
        if stuck:
            diagnosis = _report.diagnose(self.handles, self.dump_paths, self.wording)
            stacks = self.stacks(stuck)
            they = "it waits" if len(stuck) == 1 else "they wait"
            cleanup = self.stop(primary=first)
            self.drain(_DRAIN_GRACE_S)
            where = "".join(
                f"\nWhere rank {h.rank} was (most recent call last):\n{stacks[h.rank]}"
                for h in stuck
            )
            first.error = first.error and _report.with_note(
                first.error,
                f"{ranks_named(stuck).capitalize()} had not finished {_PEER_GRACE_S:g} s later: "
                f"most likely {they} in a collective rank {first.rank} will never reach.{where}",
            )
            return cleanup, diagnosis
        self.wait_relayed(targets)
        others = [h for h in targets if h is not first]
        also = [h for h in others if h.error is not None]
        fine = [h for h in others if h.done is not None]
        parts = []
        if also:
            parts.append(f"{ranks_named(also)} failed too")
        if fine:
            parts.append(f"{ranks_named(fine)} finished the call")
        said = ("; ".join(parts) + ". ") if parts else ""
        return f"{said.capitalize()}{self.wording.kept} are kept, with what they hold.", None

    def _raise_timeout(
        self,
        targets: list[RankHandle],
        timeout: float | None,
        start_timeout: float | None,
        starting: bool = False,
    ) -> None:
        running = [h for h in targets if h.process.is_alive() and not h.answered]
        paused = [h for h in running if h.paused()]
        diagnosis, stacks, cleanup = self._report_and_stop(
            running,
            records=not starting,
            grace=_DRAIN_GRACE_S,
            failed=running[0].rank if running else -1,
        )
        if starting:
            waiting = [h for h in targets if not (h.check_started() or (h.ready and h.call == 0))]
            summary = (
                f"{ranks_named(waiting).capitalize()} had not started after "
                f"start_timeout={start_timeout:g} s (starting Python, importing, joining the "
                f"group, unpickling {self.wording.sent}); every rank was stopped. The stacks "
                f"below show where they were. On a slow or busy machine, or with torch on a "
                f"network file system, pass a larger start_timeout (or None for no limit)."
            )
        elif paused:
            one = len(paused) == 1
            it, was = ("it", "was") if one else ("they", "were")
            waiting = [h for h in running if h not in paused]
            waited = (
                f"{ranks_named(waiting)} waited, most likely for {it if one else 'them'} in a "
                f"collective (stacks below). "
                if waiting
                else ""
            )
            summary = (
                f"{self.wording.work} ran past its timeout of {timeout:g} s: "
                f"{ranks_named(paused)} {was} stopped ({_report.PAUSED_HOW}), so {it} ran "
                f"nothing; {waited}A stopped rank goes "
                f"on only when continued (kill -CONT <pid>), and its peers wait for it until the "
                f"timeout. Every rank was then ended."
            )
        else:
            summary = (
                f"{self.wording.work} ran past its timeout of {timeout:g} s; still running: "
                f"{ranks_named(running) if running else 'none'}. A rank that waits in a "
                f"collective (all_reduce, barrier, ...) that another rank never calls waits "
                f"until it is stopped: look at the stacks below."
            )
        raise WorkerTimeout(
            summary,
            running=[h.rank for h in running],
            stacks=stacks,
            cleanup=cleanup,
            diagnosis=diagnosis,
        )

    def stacks(self, ranks: list[RankHandle]) -> dict[int, str]:
        """Each rank's Python stack now, from its faulthandler (works while it is blocked)."""
        paused = {h.rank for h in ranks if h.paused()}
        ranks = [h for h in ranks if h.rank not in paused]
        for h in ranks:
            h.output.diag.clear()
            if h.main_ident is None or h.process.pid is None:
                continue  # no Hello yet: its stack-dump handler may not be installed
            try:
                os.kill(h.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        until = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < until:
            before = [len(h.output.diag) for h in ranks]
            self._pump(0.3)
            grew = any(len(h.output.diag) != n for h, n in zip(ranks, before))
            if all(h.output.diag for h in ranks) and not grew:
                break
        stacks = {h.rank: _report.format_stack(bytes(h.output.diag), h.main_ident) for h in ranks}
        for rank in paused:
            stacks[rank] = (
                "  (stopped: a paused process runs nothing, so it cannot write its stack)"
            )
        return stacks

    # --- an interrupted cell -------------------------------------------------------------

    def _after_interrupt(
        self, targets: list[RankHandle], keep: bool, phase: str = "running"
    ) -> WorkerInterrupted:
        """Stop what an interrupt must stop; the error that says what the ranks were doing.

        Args:
            targets: the ranks the interrupted call went to.
            keep: a pool's call: interrupt fn on each rank and keep the ranks that stop.
            phase: "running" (a call), "starting" (a pool's ranks joining the group) or "exiting".

        Returns:
            The error to raise (``from None``: the interrupt's own frames are mgtutor's).
        """
        if keep and phase == "running" and not self.stopped:
            return self._interrupt_pool(targets)
        running = [h for h in targets if _alive(h) and not h.answered]
        paused = _paused_note(running)  # before they are stopped
        diagnosis, stacks, cleanup = self._report_and_stop(running, records=phase == "running")
        work = _lower(self.wording.work)
        if phase == "starting":
            summary = f"The cell was interrupted {_HOW} while the ranks were starting."
        elif phase == "exiting":
            summary = f"The cell was interrupted {_HOW} while the ranks were exiting."
        elif running:
            summary = (
                f"The cell was interrupted {_HOW} before {ranks_named(running)} finished {work}."
                f"{paused}"
            )
        else:
            summary = f"The cell was interrupted {_HOW} while {work} ran."
        return WorkerInterrupted(
            summary,
            running=[h.rank for h in running],
            stacks=stacks,
            cleanup=cleanup,
            diagnosis=diagnosis,
        )

    def _interrupt_pool(self, targets: list[RankHandle]) -> WorkerInterrupted:
        """Interrupt fn on every rank of a pool; stop them all if some cannot be interrupted."""
        busy = [h for h in targets if not h.answered]
        for h in busy:
            try:
                os.kill(h.process.pid, signal.SIGINT)  # type: ignore[arg-type]
            except (ProcessLookupError, TypeError):
                pass
        pressed_again = False
        try:
            self.wait_answered(targets, _INTERRUPT_GRACE_S)
        except KeyboardInterrupt:
            pressed_again = True  # stop them below, without asking where they are
        stuck = [h for h in targets if not h.answered]
        died = [h for h in self.handles if h.failed_at is not None and h.error is None]
        # Where each rank that did stop was: its KeyboardInterrupt's traceback.
        interrupted = [
            h for h in busy if h.error is not None and h.error.context == "was interrupted"
        ]
        where = {
            h.rank: frames
            for h in interrupted
            if h.error is not None and (frames := _frames(h.error.traceback))
        }
        work = _lower(self.wording.work)
        if not (stuck or died):
            self.wait_relayed(targets)
            if self.board is not None:
                self.board.finish(-1)
            summary = (
                f"The cell was interrupted {_HOW}: {work} stopped on every rank; "
                f"{_lower(self.wording.kept)} are kept, with what they hold."
            )
            return WorkerInterrupted(summary, running=[h.rank for h in busy], stacks=where)
        paused = _paused_note(stuck)  # before they are stopped
        diagnosis, stacks, cleanup = self._report_and_stop(
            stuck, records=True, ask=not pressed_again
        )
        summary = (
            f"The cell was interrupted {_HOW} before {ranks_named(busy)} finished {work}; "
            f"{ranks_named(stuck + died)} did not stop within {_INTERRUPT_GRACE_S:g} s (native "
            f"code such as a collective cannot be interrupted).{paused}"
        )
        return WorkerInterrupted(
            summary,
            running=[h.rank for h in busy],
            stacks={**where, **stacks},
            cleanup=cleanup,
            diagnosis=diagnosis,
        )

    def _report_and_stop(
        self,
        ranks: list[RankHandle],
        records: bool,
        grace: float = 0.2,
        ask: bool = True,
        failed: int = -1,
    ) -> tuple[Any, dict[int, str], str]:
        """What a timeout's or an interrupt's error reports, then every rank stopped.

        Asks (unless ``ask`` is false) for the doctor's diagnosis (with ``records``: it waits
        1 s for the ranks' records) and the stacks of ``ranks`` (within 2 s); a second interrupt
        ends the asking and keeps what came. Then stops every rank (an interrupt meanwhile starts
        the stopping again rather than end it), relays what they wrote for up to ``grace``
        seconds and closes the progress board, ``failed`` the rank it marks failed (-1: none).

        Returns:
            The diagnosis (or None), the stacks by rank, and the cleanup line.
        """
        diagnosis: Any = None
        stacks: dict[int, str] = {}
        try:
            if ask and records:
                diagnosis = _report.diagnose(self.handles, self.dump_paths, self.wording)
            if ask:
                stacks = self.stacks(ranks)
        except KeyboardInterrupt:
            pass
        try:
            cleanup = self.stop()
        except KeyboardInterrupt:
            cleanup = self.stop()
        self.drain(grace)
        if self.board is not None:
            self.board.finish(failed)
        return diagnosis, stacks, cleanup

    # --- the end ----------------------------------------------------------------------------

    def wait_answered(self, targets: list[RankHandle], seconds: float) -> None:
        """Relay and reap until every target answered its call (or ended), or ``seconds``."""
        until = time.monotonic() + seconds
        while time.monotonic() < until and not all(h.answered for h in targets):
            self._pump(0.05)
            self._reap()

    def wait_relayed(self, targets: list[RankHandle]) -> None:
        """Relay until each target's output of its call has been relayed, or a grace."""
        until = time.monotonic() + _DRAIN_GRACE_S
        while time.monotonic() < until and not all(h.output.relayed(h.call) for h in targets):
            self._pump(0.05)

    def drain(self, grace: float) -> None:
        """Relay what the ranks wrote before they ended, until their pipes close or ``grace``."""
        until = time.monotonic() + grace
        while time.monotonic() < until and any(h.output.open - {"diag"} for h in self.handles):
            self._pump(0.05)
            self._reap()

    def close(self, exit_message: Exit) -> None:
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
                    self._pump(POLL_S)
                    self._reap()
                    _cleanup.stop_lingering(self.handles)
                self.drain(_DRAIN_GRACE_S)
                _cleanup.stop_leftovers(self.handles)
            except KeyboardInterrupt:
                raise self._after_interrupt(started, False, "exiting") from None
            finally:
                self._close_pipes()
            return
        if any(h.process.pid is not None and h.process.is_alive() for h in self.handles):
            self.stop()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if any(h.process.pid is not None and h.process.is_alive() for h in self.handles):
            self.stop()
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


def _paused_note(ranks: list[RankHandle]) -> str:
    """A sentence naming the ranks that are stopped (SIGSTOP, Ctrl-Z, gdb), or ""."""
    paused = [h for h in ranks if h.paused()]
    if not paused:
        return ""
    was = "was" if len(paused) == 1 else "were"
    return (
        f" {ranks_named(paused).capitalize()} {was} stopped ({PAUSED_HOW}): a paused rank runs "
        f"nothing, and its peers wait for "
        f"it."
    )


def _alive(h: RankHandle) -> bool:
    return h.process.pid is not None and h.exitcode is None and h.process.is_alive()


def _lower(text: str) -> str:
    """The wording's phrase inside a sentence: "The %%ddp cell" becomes "the %%ddp cell"."""
    return text[:1].lower() + text[1:]


def _frames(traceback_text: str) -> str:
    """A rank's formatted traceback without its heading and its closing exception line."""
    lines = traceback_text.rstrip().splitlines()
    if lines and lines[0].startswith("Traceback"):
        lines = lines[1:]
    if lines and not lines[-1].startswith(" "):
        lines = lines[:-1]
    # The innermost frames are the rank's SIGINT handler (mgtutor's), not where fn was.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    while True:
        last = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=None)
        if last is None or not lines[last][len('  File "') :].startswith(package):
            return "\n".join(lines)
        lines = lines[:last]
