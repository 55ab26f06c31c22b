"""The notebook's view of one rank process (its pipes, call and answer); the Run built from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from mgtutor.errors import WorkerError
from mgtutor.launcher._relay import RankOutput
from mgtutor.launcher.run import RankResult, Run
from mgtutor.measure.timing import PhaseRecord
from mgtutor.wire.messages import Done, Failed

__all__ = ["RankHandle", "agreed_backend", "build_run", "with_wall_time"]


@dataclass
class RankHandle:
    """The notebook's view of one rank process."""

    rank: int
    process: BaseProcess
    conn: Connection
    output: RankOutput
    main_ident: int | None = None
    ready: bool = False
    backend: str | None = None  # its process group's, as it said when ready (None: no group)
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

    def paused(self) -> bool:
        """True while the rank's process is stopped: by SIGSTOP, by Ctrl-Z's SIGTSTP, or by a
        native debugger that holds it (gdb, lldb; not pdb, whose breakpoint leaves the process
        running). It then runs nothing, not even its stack dump, until it is continued."""
        import psutil

        if self.process.pid is None:
            return False
        try:
            status = psutil.Process(self.process.pid).status()
        except (psutil.Error, ValueError):
            return False
        return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def agreed_backend(handles: list[RankHandle]) -> str | None:
    """The backend the ranks' process group uses, as each said when ready; None if they made none.

    Raises:
        WorkerError: the ranks said different backends (each rank's is named).
    """
    said = {h.backend for h in handles}
    if len(said) <= 1:
        return said.pop() if said else None
    odd = next(h for h in handles if h.backend != handles[0].backend)
    each = ", ".join(f"rank {h.rank}: {h.backend}" for h in handles)
    raise WorkerError(
        f"the ranks joined the process group with different backends ({each}). Pass the "
        f"backend to use (backend='gloo' or 'nccl') or set MGTUTOR_BACKEND, so every rank uses it.",
        rank=odd.rank,
    )


def build_run(handles: list[RankHandle], world_size: int, started: float, finished: float) -> Run:
    import cloudpickle

    ranks = []
    for h in handles:
        assert h.done is not None
        record = h.done.record
        try:
            result = cloudpickle.loads(h.done.result)
        except Exception as exc:
            raise WorkerError(
                f"rank {h.rank} finished, but the notebook could not unpickle its result: {exc}. "
                f"Return plain values (numbers, lists, dicts, tensors) from fn.",
                rank=h.rank,
            ) from exc
        timings = [
            PhaseRecord(p.name, p.step, p.start - started, p.end - started, p.samples, p.nbytes)
            for p in record["timings"]
        ]
        ranks.append(
            RankResult(
                rank=h.rank,
                pid=record["pid"],
                device=record["device"],
                backend=record["backend"],
                wall_time_s=record["finished"] - record["started"],
                memory=record["memory"],
                result=result,
                timings=timings,
                breakdown=record.get("breakdown"),
            )
        )
    return Run(world_size=world_size, ranks=ranks, wall_time_s=finished - started)


def with_wall_time(run: Run, wall_time_s: float) -> Run:
    """The same run with another wall time (a launch counts its start and exit too)."""
    return dataclasses.replace(run, wall_time_s=wall_time_s)
