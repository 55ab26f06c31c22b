"""What an interrupted cell (Stop, Kernel > Interrupt, Ctrl+C) stops, and what it tells the learner.

Ranks that hang are most often stopped this way: ``launch`` and ``Pool.run`` have no time limit
by default. So an interrupt asks the live ranks for their records of collectives and their
stacks, as a timeout does (:mod:`._report`, :mod:`mgtutor.doctor`), for at most a few seconds,
then stops what must stop (:mod:`._cleanup`), and raises
:class:`~mgtutor.errors.WorkerInterrupted`: it opens with the doctor's finding ("rank 1 never
reached all_reduce #1, which rank 0 is waiting in"), says what was stopped and where each rank
was, and shows none of mgtutor's frames. A second interrupt skips the asking and stops at once.

A pool first interrupts fn on each rank (SIGINT): ranks that stop are kept; ranks blocked in
native code (a collective) cannot be interrupted and are stopped, as a launch's always are.

Each function takes the :class:`~._supervise.Supervisor` whose wait was interrupted, typed as
:class:`Supervising`, what they use of it: ``_supervise`` imports this module, and the layout
test forbids import loops, even an import only for type checking.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Protocol

from mgtutor.errors import WorkerInterrupted
from mgtutor.launcher import _report
from mgtutor.launcher._handle import RankHandle
from mgtutor.launcher._report import PAUSED_HOW, Wording, ranks_named
from mgtutor.launcher.progress_bars import ProgressBoard

__all__ = ["Supervising", "after_interrupt"]

# A pool's ranks get this long to stop fn (KeyboardInterrupt in each) before they are stopped.
_INTERRUPT_GRACE_S = 3.0
_HOW = "(Stop, Kernel > Interrupt or Ctrl+C)"


class Supervising(Protocol):
    """What an interrupt uses of the :class:`~._supervise.Supervisor` whose wait it ended."""

    handles: list[RankHandle]
    board: ProgressBoard | None
    wording: Wording
    dump_paths: dict[int, str]
    stopped: bool

    def stop(self, primary: RankHandle | None = None) -> str: ...
    def stacks(self, ranks: list[RankHandle]) -> dict[int, str]: ...
    def wait_answered(self, targets: list[RankHandle], seconds: float) -> None: ...
    def wait_relayed(self, targets: list[RankHandle]) -> None: ...
    def drain(self, grace: float) -> None: ...


def after_interrupt(
    sup: Supervising, targets: list[RankHandle], keep: bool, phase: str = "running"
) -> WorkerInterrupted:
    """Stop what an interrupt must stop; the error that says what the ranks were doing.

    Args:
        sup: the supervisor whose wait was interrupted.
        targets: the ranks the interrupted call went to.
        keep: a pool's call: interrupt fn on each rank and keep the ranks that stop.
        phase: "running" (a call), "starting" (a pool's ranks joining the group) or "exiting".

    Returns:
        The error to raise (``from None``: the interrupt's own frames are mgtutor's).
    """
    if keep and phase == "running" and not sup.stopped:
        return _interrupt_pool(sup, targets)
    running = [h for h in targets if _alive(h) and not h.answered]
    paused = _paused_note(running)  # before they are stopped
    diagnosis, stacks = _gathered(sup, running, records=phase == "running")
    cleanup = _stop_anyway(sup)
    sup.drain(0.2)
    _finish_board(sup)
    work = _lower(sup.wording.work)
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


def _interrupt_pool(sup: Supervising, targets: list[RankHandle]) -> WorkerInterrupted:
    """Interrupt fn on every rank of a pool; stop them all if some cannot be interrupted."""
    busy = [h for h in targets if not h.answered]
    for h in busy:
        try:
            os.kill(h.process.pid, signal.SIGINT)  # type: ignore[arg-type]
        except (ProcessLookupError, TypeError):
            pass
    pressed_again = False
    try:
        sup.wait_answered(targets, _INTERRUPT_GRACE_S)
    except KeyboardInterrupt:
        pressed_again = True  # stop them below, without asking where they are
    stuck = [h for h in targets if not h.answered]
    died = [h for h in sup.handles if h.failed_at is not None and h.error is None]
    # Where each rank that did stop was: its KeyboardInterrupt's traceback.
    interrupted = [h for h in busy if h.error is not None and h.error.context == "was interrupted"]
    where = {
        h.rank: frames
        for h in interrupted
        if h.error is not None and (frames := _frames(h.error.traceback))
    }
    work = _lower(sup.wording.work)
    if not (stuck or died):
        sup.wait_relayed(targets)
        _finish_board(sup)
        summary = (
            f"The cell was interrupted {_HOW}: {work} stopped on every rank; "
            f"{_lower(sup.wording.kept)} are kept, with what they hold."
        )
        return WorkerInterrupted(summary, running=[h.rank for h in busy], stacks=where)
    paused = _paused_note(stuck)  # before they are stopped
    diagnosis, stacks = (None, {}) if pressed_again else _gathered(sup, stuck, records=True)
    cleanup = _stop_anyway(sup)
    sup.drain(0.2)
    _finish_board(sup)
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


def _gathered(
    sup: Supervising, ranks: list[RankHandle], records: bool
) -> tuple[Any, dict[int, str]]:
    """The doctor's diagnosis and the ranks' stacks, as a timeout takes them.

    Bounded: the doctor waits 1 s for the ranks' records, the stacks come within 2 s. A second
    interrupt ends the asking; what came by then is kept.
    """
    diagnosis: Any = None
    stacks: dict[int, str] = {}
    try:
        if records:
            diagnosis = _report.diagnose(sup.handles, sup.dump_paths, sup.wording)
        stacks = sup.stacks(ranks)
    except KeyboardInterrupt:
        pass
    return diagnosis, stacks


def _stop_anyway(sup: Supervising) -> str:
    """Stop every rank; an interrupt meanwhile starts the stopping again rather than end it."""
    try:
        return sup.stop()
    except KeyboardInterrupt:
        return sup.stop()


def _finish_board(sup: Supervising) -> None:
    if sup.board is not None:
        sup.board.finish(-1)


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
