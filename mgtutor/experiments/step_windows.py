"""What each rank of the step-time check measures per step, and how crowded each window was.

:func:`measure_rank` runs on each rank of :func:`mgtutor.experiments.step_check.check`: a
configuration's steps, with the re-timings that set each step's prediction, and over each window
(those timings, then the step) the CPU seconds and run-queue waits that say whether other work
crowded the ranks; :func:`window_crowding` turns one window of every rank into one figure, which
:attr:`mgtutor.experiments.step_check.Measured.why_not` compares with
:data:`~mgtutor.experiments.step_check.CROWDED`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from mgtutor.experiments.step_calibrate import (
    CHECK_MODEL,
    CLOCKS,
    reference_rate,
    small_calls,
    step_clock,
)

__all__ = ["WINDOW", "measure_rank", "window_crowding"]

#: per step: the CPUs' busy seconds, the rank's own, wall-clock, its threads' run-queue waits
WINDOW = ("busy", "own", "wall", "waited")


def measure_rank(config: Any, steps: int, window: float, calls: int) -> dict[str, list]:
    """This rank's seconds of ``steps`` steps, each started together; before each, for real
    configurations, the reference product's FLOP/s and (2 ranks) the small collectives'; and
    over each window (those timings and the step) the busy CPU seconds of the CPUs the rank
    may run on, its own (all its threads), the wall-clock seconds and the seconds its threads
    waited for a core (:func:`window_crowding`). A real configuration's steps and rates are
    read on :func:`~mgtutor.experiments.step_calibrate.step_clock`'s clock, the rates kept under
    ``"rate_cpu"`` or ``"rate_wall"``; an emulated one's steps in wall-clock seconds."""
    import torch.distributed as dist

    from mgtutor.experiments import step_builds
    from mgtutor.measure.emulated import meeting_seconds
    from mgtutor.measure.other_work import busy_seconds, waited_seconds
    from mgtutor.worker import setup

    setup()
    together = config.ranks > 1
    step, wire = step_builds.build(config)
    step()  # warm-up: DDP's buckets, the pipeline's shapes, the allocator
    small = small_calls(config.model) if together and not config.emulated else {}
    clock = "wall" if config.emulated else step_clock(config.ranks)
    timer = CLOCKS[clock].timer
    rate = f"rate_{clock}"
    out: dict[str, list] = {k: [] for k in ("seconds", rate, "wire", *WINDOW, *small)}
    for _ in range(steps):
        if together:
            dist.barrier()
        opened, busy, own = time.perf_counter(), busy_seconds(), time.process_time()
        waited = waited_seconds()
        if not config.emulated:
            out[rate].append(reference_rate(CHECK_MODEL, window, timer))
            for kind, calls_of in small.items():
                out[kind].append(calls_of(calls))
        elif wire is not None and config.pp == 1:
            out["wire"].append(meeting_seconds(wire, calls))
        if together:
            dist.barrier()
        start = timer()
        step()
        out["seconds"].append(timer() - start)
        out["busy"].append(busy_seconds() - busy)
        out["own"].append(time.process_time() - own)
        out["wall"].append(time.perf_counter() - opened)
        out["waited"].append(waited_seconds() - waited)
    if wire is not None:
        wire.close()
    return out


def window_crowding(per_rank: list[dict[str, list]], i: int, emulated: bool = False) -> float:
    """How crowded window ``i`` of :func:`measure_rank`'s results (one per rank) was: other
    work's CPU in cores (the busy seconds of the longer window less every rank's own, over its
    wall-clock seconds), or, ``emulated``, the seconds the ranks' threads waited for a core over
    the wall-clock seconds (:func:`~mgtutor.measure.other_work.waited_seconds`; other work's
    CPU where the kernel does not say). Not the calibration's figure
    (:class:`~mgtutor.measure.other_work.OtherWork`, which counts this process tree's CPU as its
    own from outside): the ranks count their own here, per window. Not clipped at 0: /proc/stat
    counts in 10 ms ticks, process_time in nanoseconds, so a quiet window reads a little either
    side of 0, and a median of clipped values would call a quiet machine busy."""
    wall = max(r["wall"][i] for r in per_rank)
    waited = sum(r["waited"][i] for r in per_rank)
    if emulated and not math.isnan(waited):
        return waited / wall
    busy = max(r["busy"][i] for r in per_rank)
    own = sum(r["own"][i] for r in per_rank)
    return (busy - own) / wall
