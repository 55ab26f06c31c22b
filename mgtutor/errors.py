"""The exceptions a launch raises when a worker fails, hangs or is killed.

Every error names the rank, says what happened and what was cleaned up, and carries the
worker's own traceback or stack so a learner can find the line that failed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerError", "WorkerTimeout"]

# What mgtutor.doctor can name as the cause: ranks that did not call the same collectives.
_DESYNCS = ("behind", "finished", "order", "operation", "shape", "dtype", "p2p")


class WorkerError(RuntimeError):
    """A worker of :func:`mgtutor.launch` failed: it raised, exited early or was killed.

    Attributes:
        rank: the rank that failed first.
        exc_type: the qualified name of the exception the worker raised (``None`` if it died
            without raising, for example killed by a signal).
        exc_message: that exception's message.
        worker_traceback: the worker's formatted traceback (empty if it died without one).
        exitcode: the worker process's exit code; negative means killed by signal ``-exitcode``.
        signal_name: the signal's name (``"SIGKILL"``) when the worker was killed by one.
        cleanup: a sentence saying which other ranks were stopped.
        original: the worker's exception object when it could be sent back, else ``None``.
        diagnosis: what the ranks' records of their collectives say went wrong
            (:class:`mgtutor.doctor.Diagnosis`, its raw records in ``.records``), or None.
    """

    def __init__(
        self,
        summary: str,
        *,
        rank: int,
        exc_type: str | None = None,
        exc_message: str = "",
        worker_traceback: str = "",
        exitcode: int | None = None,
        signal_name: str | None = None,
        cleanup: str = "",
        original: BaseException | None = None,
        diagnosis: Any = None,
    ) -> None:
        self.summary = summary
        self.diagnosis = diagnosis
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.cleanup = cleanup
        self.original = original
        super().__init__(self._compose())

    def _lead(self) -> list[str]:
        """The doctor's finding first, when it found something; then the summary."""
        found = self.diagnosis
        if found is None or found.kind == "agree":
            return [self.summary]
        if found.kind not in _DESYNCS:
            # A missing record (a rank that died) or no recorder: the summary says more.
            return [self.summary, f"(The ranks' records of collectives: {found.summary}.)"]
        details = [f"  {line}" for line in found.details]
        return [found.summary, *details, self.summary]

    def _compose(self) -> str:
        parts = self._lead()
        if self.cleanup:
            parts.append(self.cleanup)
        if self.worker_traceback:
            parts.append(f"\nTraceback in rank {self.rank}:\n{self.worker_traceback.rstrip()}")
        return "\n".join(parts)


class WorkerTimeout(WorkerError):
    """The launch ran past its ``timeout``; every rank was stopped.

    Attributes:
        running: the ranks that had not finished when the time ran out.
        stacks: for each of those ranks, the Python stack it was in (from ``faulthandler``).
    """

    def __init__(
        self,
        summary: str,
        *,
        running: list[int],
        stacks: dict[int, str],
        cleanup: str = "",
        diagnosis: Any = None,
    ) -> None:
        self.running = running
        self.stacks = stacks
        super().__init__(
            summary, rank=running[0] if running else -1, cleanup=cleanup, diagnosis=diagnosis
        )

    def _compose(self) -> str:
        parts = self._lead()
        if self.cleanup:
            parts.append(self.cleanup)
        for rank in self.running:
            stack = self.stacks.get(rank, "").rstrip() or "  (no stack came back from this rank)"
            parts.append(f"\nWhere rank {rank} was stuck (most recent call first):\n{stack}")
        return "\n".join(parts)
