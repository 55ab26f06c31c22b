"""What a launch returns: each rank's result, device, wall time, memory and timing records."""

from __future__ import annotations

import html
import reprlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mgtutor.measure.memory import MemoryStats
from mgtutor.measure.timing import STEP, PhaseRecord
from mgtutor.plan.memplan import MemoryBreakdown
from mgtutor.units import format_bytes

__all__ = ["WARMUP_FACTOR", "RankResult", "Run", "count_warmup"]

#: A leading step is warm-up when it took more than this many times the later steps' median.
WARMUP_FACTOR = 3.0


def count_warmup(times: Sequence[float], factor: float = WARMUP_FACTOR) -> int:
    """How many leading steps were warm-up: each over ``factor`` x the median of steps 1 on.

    The first steps pay once for what later steps reuse (on a GPU: CUDA's context, cuDNN's
    choice of algorithms, the allocator's first blocks; under DDP: the rebuilt buckets). At most
    half the steps count, so a run that slows down is not mistaken for one that warms up.

    Args:
        times: step durations in order.
        factor: how much slower than the median a step must be to count.

    Returns:
        The number of leading steps that were warm-up (0 for fewer than two steps).

    Example:
        >>> count_warmup([0.6, 0.002, 0.002, 0.002])
        1
    """
    if len(times) < 2:
        return 0
    typical = statistics.median(times[1:])
    count = 0
    for duration in times[: len(times) // 2]:
        if duration <= factor * typical:
            break
        count += 1
    return count


def _short(value: Any, width: int = 48) -> str:
    text = " ".join(reprlib.repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass(frozen=True)
class RankResult:
    """One rank's outcome.

    Attributes:
        rank: the rank.
        pid: its worker process id.
        device: the device it used ("cpu", "cuda:1").
        backend: its process group's backend, or None if fn never called setup().
        wall_time_s: how long fn ran in that rank, from call to return.
        memory: its peak memory figures (see :mod:`mgtutor.measure.memory` for what each counts).
        result: what fn returned there.
        timings: the intervals it recorded with :mod:`mgtutor.measure.timing`, times relative to the
            launch's start.
        breakdown: what :func:`mgtutor.track` named in fn, by category (see
            :class:`~mgtutor.measure.breakdown.MemoryBreakdown`); None if fn tracked nothing.
    """

    rank: int
    pid: int
    device: str
    backend: str | None
    wall_time_s: float
    memory: MemoryStats
    result: Any
    timings: list[PhaseRecord] = field(default_factory=list)
    breakdown: MemoryBreakdown | None = None


@dataclass(frozen=True)
class Run:
    """What :func:`mgtutor.launch` or a pool's call returns: a :class:`RankResult` per rank.

    The ranks are in rank order: every rank for a launch, the ranks a call ran on for
    :meth:`mgtutor.Pool.run` with ``ranks=``.

    Attributes:
        world_size: number of ranks.
        ranks: per-rank outcomes.
        wall_time_s: the whole launch as the notebook saw it, process start to last exit.
    """

    world_size: int
    ranks: list[RankResult]
    wall_time_s: float

    @property
    def results(self) -> list[Any]:
        """What fn returned, indexed by rank: ``run.results[1]`` is rank 1's."""
        return [r.result for r in self.ranks]

    @property
    def backend(self) -> str | None:
        """The backend the ranks used (None if they made no process group)."""
        return self.ranks[0].backend if self.ranks else None

    @property
    def timings(self) -> dict[int, list[PhaseRecord]]:
        """Timing records by rank."""
        return {r.rank: r.timings for r in self.ranks}

    def step_times(self, rank: int) -> list[float]:
        """Durations in seconds of the steps ``rank`` recorded with ``mgtutor.step()``."""
        return [p.duration for p in self.ranks[rank].timings if p.name == STEP]

    @property
    def steps(self) -> int:
        """The most steps any rank recorded with ``mgtutor.step()``."""
        return max((sum(p.name == STEP for p in r.timings) for r in self.ranks), default=0)

    @property
    def warmup_steps(self) -> int:
        """Leading steps treated as warm-up (:func:`count_warmup`), the most on any rank.

        :func:`mgtutor.plot_step_times` marks them and scales its axis to the steps after them,
        and :func:`mgtutor.plot_timeline` starts its default window after them.
        """
        per_rank = [[p.duration for p in r.timings if p.name == STEP] for r in self.ranks]
        return max((count_warmup(times) for times in per_rank), default=0)

    def _steps_note(self) -> str:
        """``"64 steps, 1 treated as warm-up"``; empty when no rank recorded steps."""
        if not self.steps:
            return ""
        return f"{self.steps} steps, {self.warmup_steps} treated as warm-up"

    def phase_totals(self, rank: int) -> dict[str, float]:
        """Seconds ``rank`` spent in each named phase, summed over steps."""
        totals: dict[str, float] = {}
        for p in self.ranks[rank].timings:
            if p.name != STEP:
                totals[p.name] = totals.get(p.name, 0.0) + p.duration
        return totals

    def throughput(self) -> float:
        """Samples per second of the whole job, from the ranks' step records.

        All ranks' samples over the time from the first step's start to the last step's end
        on any rank, so the slowest rank sets the pace, as it does in synchronous training.

        Raises:
            ValueError: when no rank recorded steps with ``samples=``.
        """
        steps = [p for r in self.ranks for p in r.timings if p.name == STEP]
        counted = [p for p in steps if p.samples is not None]
        if not counted:
            raise ValueError(
                "this run has no step records with samples; inside fn wrap each training step "
                "in `with mgtutor.step(samples=batch_size):`"
            )
        span = max(p.end for p in counted) - min(p.start for p in counted)
        return sum(p.samples or 0 for p in counted) / span

    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for r in self.ranks:
            mem = r.memory
            if mem.is_cuda:
                memory = (
                    f"{format_bytes(mem.peak_allocated)} alloc / "
                    f"{format_bytes(mem.peak_reserved)} reserved"
                )
            else:
                memory = f"{format_bytes(mem.peak_rss)} RSS"
            rows.append(
                (
                    str(r.rank),
                    r.device,
                    r.backend or "-",
                    f"{r.wall_time_s:.3f} s",
                    memory,
                    _short(r.result),
                )
            )
        return rows

    _HEADER = ("rank", "device", "backend", "wall time", "peak memory", "result")

    def __repr__(self) -> str:
        rows = [self._HEADER, *self._rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._HEADER))]
        steps = f", {self._steps_note()}" if self.steps else ""
        lines = [f"Run(world_size={self.world_size}, wall_time={self.wall_time_s:.2f} s{steps})"]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self._rows()
        )
        caption = (
            f"mgtutor Run: world_size={self.world_size}, launch wall time {self.wall_time_s:.2f} s"
        )
        if self.steps:
            caption += f"; {self._steps_note()}"
        return (
            f"<table><caption style='text-align:left'>{html.escape(caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )
