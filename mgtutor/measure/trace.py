"""What torch's profiler records in each rank, DDP's own all-reduces among it; one file for all.

In a rank, around the steps to look at, then in the notebook::

    with mgtutor.record_trace() as trace:          # in fn, on every rank
        for batch in ...:
            with mgtutor.step(samples=len(x)): ...
    return {"trace": trace}

    mgtutor.write_trace([r["trace"] for r in run.results], "ddp_trace.json")

:func:`record_trace` runs ``torch.profiler`` over the block. The process group itself records
each collective there, nothing replaced: on gloo an event named after the backend and the
collective ("gloo:all_reduce"), from when one of gloo's worker threads began
it to when it completed, with the tensor's shape. Those are DDP's C++ all-reduces. They are also
added to the rank's timer as "allreduce" records, from the caller's launch (the reducer's call of
``c10d::allreduce_``) to gloo's completion (:func:`mgtutor.plot_timeline` draws them), and the
timer's ``step()``/``phase()`` spans are added to the trace.

:func:`write_trace` writes the ranks' traces as one Chrome trace JSON, a process per rank, that
Perfetto (ui.perfetto.dev) or chrome://tracing opens. The clock: the profiler stamps events in
Unix time from the system clock (its ``ts`` plus the file's ``baseTimeNanoseconds``), one clock
for every process of a machine. Ranks on one machine keep their times, less one zero: the
earliest rank's exit from a barrier at the block's start. Ranks on several machines, whose clocks
may differ by milliseconds, are each shifted so that their own barrier exit is zero: right to
within the barrier's last message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mgtutor.measure.timing import STEP, PhaseRecord, StepTimer, timer

if TYPE_CHECKING:
    from torch.profiler import profile

__all__ = ["Collective", "RankTrace", "merge_traces", "record_trace", "write_trace"]

BARRIER = "mgtutor: barrier (the clocks' zero)"
CLOSING = "mgtutor: closing barrier (every collective's event closed)"
# torch 2.11's profiler warns at every start (profiler.py, prepare_trace), 2.14's only when one
# object is started twice: record_trace starts each once, so the warning never applies.
_CYCLE_WARNING = r".*Profiler clears events at the end of each cycle"
_PHASES_TID = 0  # the track of the timer's step()/phase() spans; no OS thread has id 0
_ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "int": 4,
    "long int": 8,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


@dataclass(frozen=True)
class Collective:
    """One collective as the process group recorded it on one rank (times in Unix µs).

    Attributes:
        rank: the rank that ran it.
        name: the event's name, the backend's and the collective's ("gloo:all_reduce").
        start: when the backend began it (on gloo: one of its worker threads).
        end: when it completed on this rank.
        nbytes: the tensors' bytes, from the shapes the profiler recorded (None if unknown).
        launched: when the caller (DDP's reducer, ``dist.all_reduce``) called the collective's
            operator, ``c10d::allreduce_`` for an all-reduce; None when the
            trace did not hold one such call per collective.
        numel: the elements of its (first) tensor, from the recorded shape.
    """

    rank: int
    name: str
    start: float
    end: float
    nbytes: int | None
    launched: float | None = None
    numel: int | None = None

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return (self.end - self.start) / 1e6


@dataclass
class RankTrace:
    """One rank's profile: Chrome trace events, ``ts`` in Unix µs and ``pid`` the rank.

    Attributes:
        rank: the rank.
        host: the machine it ran on (ranks on one machine share a clock).
        backend: the process group's backend ("gloo", "nccl"), or "" without one.
        barrier_end: when this rank left the barrier at the start (Unix µs).
        events: the events, filled when :func:`record_trace`'s block ends.
    """

    rank: int
    host: str
    backend: str
    barrier_end: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)

    def collectives(self, kind: str | None = None) -> list[Collective]:
        """The collectives the backend recorded, in the order they began.

        Args:
            kind: only those whose name ends with ``":" + kind`` ("all_reduce"); all by default.
        """
        prefix = f"{self.backend}:"
        found = [
            Collective(self.rank, e["name"], e["ts"], e["ts"] + e["dur"], _nbytes(e), None,
                       _numel(e))  # fmt: skip
            for e in sorted(self.events, key=lambda e: e.get("ts", 0))
            if e.get("ph") == "X"
            and e.get("cat") == "user_annotation"
            and e["name"].startswith(prefix)
        ]
        kernels = [
            e for e in self.events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()
        ]
        if kernels and len(kernels) == len(found):
            # NCCL: the CPU event is only the launch; its kernel ran later on the GPU, in order.
            found = [
                dataclasses.replace(c, start=k["ts"], end=k["ts"] + k["dur"])
                for c, k in zip(found, sorted(kernels, key=lambda k: k["ts"]))
            ]
        by_kind: dict[str, list[Collective]] = {}
        for c in found:
            by_kind.setdefault(c.name, []).append(c)
        launched = []
        for name, group in by_kind.items():
            # The caller's operator for "gloo:all_reduce" is "c10d::allreduce_".
            op = "c10d::" + name.split(":", 1)[1].replace("_", "") + "_"
            calls = [e for e in self.events if e.get("ph") == "X" and e["name"] == op]
            launched += _pair_launches(group, sorted(calls, key=lambda e: e["ts"]))
        wanted = [c for c in launched if kind is None or c.name == prefix + kind]
        return sorted(wanted, key=lambda c: c.start)


def _pair_launches(group: list[Collective], calls: list[dict[str, Any]]) -> list[Collective]:
    """Each collective with the call that launched it: in call order, the first to begin after
    the call with the same number of elements. Gloo's threads take work in the order it was
    queued, but two threads can note their beginnings in either order; sizes tell them apart."""
    if len(calls) != len(group):
        return group
    free = sorted(group, key=lambda c: c.start)
    paired = []
    for call in calls:
        dims = call.get("args", {}).get("Input Dims") or [[[]]]
        numel = math.prod(dims[0][0]) if dims[0] and isinstance(dims[0][0], list) else None
        match = next((c for c in free if c.start >= call["ts"] and c.numel == numel), None)
        if match is None:
            return group  # not the calls these collectives came from: leave them unpaired
        free.remove(match)
        paired.append(dataclasses.replace(match, launched=call["ts"]))
    return paired


def _numel(event: dict[str, Any]) -> int | None:
    dims = event.get("args", {}).get("Input Dims")
    return math.prod(dims[0]) if dims else None


def _nbytes(event: dict[str, Any]) -> int | None:
    types, numel = event.get("args", {}).get("Input type"), _numel(event)
    if numel is None or not types or types[0] not in _ELEMENT_BYTES:
        return None
    return numel * _ELEMENT_BYTES[types[0]]


def _unix_minus_perf() -> float:
    """time.time() - time.perf_counter(), read back to back (the tightest of five readings)."""
    readings = []
    for _ in range(5):
        before = time.perf_counter()
        unix = time.time_ns() / 1e9
        after = time.perf_counter()
        readings.append((after - before, unix - (before + after) / 2))
    return min(readings)[1]


@contextmanager
def record_trace(step_timer: StepTimer | None = None) -> Iterator[RankTrace]:
    """Profile the block on this rank with ``torch.profiler``; the trace fills in at its end.

    Every rank must enter it and leave it: it starts with a barrier (the zero of
    :func:`write_trace`'s clock) and ends with one, which waits for the collectives launched in
    the block to finish. The process group's collectives in the block become "allreduce" (and
    other) records of ``step_timer`` (the default timer if None), numbered by the step they were
    launched in; the timer's own records of the block are added to the trace.

    Args:
        step_timer: the timer to exchange records with.

    Yields:
        The :class:`RankTrace`, empty until the block ends; return it from fn.

    Example:
        >>> with record_trace() as trace:  # inside a launched fn
        ...     model(x).sum().backward()
        >>> [c.name for c in trace.collectives("all_reduce")]
        ['gloo:all_reduce']
    """
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    step_timer = step_timer or timer()
    joined = dist.is_available() and dist.is_initialized()
    backend = str(dist.get_backend()) if joined else ""
    trace = RankTrace(dist.get_rank() if joined else 0, socket.gethostname(), backend)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    # Kineto logs its start and stop, and on a CUDA build without a GPU an "ERROR" that it found
    # none, to the rank's stderr: noise in a cell. Level 6 is above its highest.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    offset_before = _unix_minus_perf()
    with ExitStack() as stack:
        with warnings.catch_warnings():  # only around the start: the block's own warnings show
            warnings.filterwarnings("ignore", message=_CYCLE_WARNING, category=UserWarning)
            prof = stack.enter_context(profile(activities=activities, record_shapes=True))

        def barrier() -> None:
            if backend == "nccl":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            elif joined:
                dist.barrier()

        with record_function(BARRIER):
            barrier()
        begun = time.perf_counter()
        yield trace
        ended = time.perf_counter()
        # Gloo marks a collective's result ready, then closes its profiler event: a caller that
        # waited on the result (DDP does) can reach the end of the block first, and the profile
        # then holds that event open (torch 2.4: zero duration, no shapes). Gloo's barrier waits
        # for every collective queued or running when it was called, each to its close
        # (ProcessGroupGloo.cpp, barrier's "priorWork").
        with record_function(CLOSING):
            barrier()
    offset_after = _unix_minus_perf()
    trace.events = _read_events(prof, trace.rank)
    trace.barrier_end = max(e["ts"] + e["dur"] for e in trace.events if e["name"] == BARRIER)
    closing = min(e["ts"] for e in trace.events if e["name"] == CLOSING)

    def to_perf(unix_us: float) -> float:  # the timer's clock, the offset interpolated
        share = (unix_us / 1e6 - offset_before - begun) / max(ended - begun, 1e-9)
        return unix_us / 1e6 - (offset_before + (offset_after - offset_before) * share)

    def to_unix(perf: float) -> float:
        share = (perf - begun) / max(ended - begun, 1e-9)
        return 1e6 * (perf + offset_before + (offset_after - offset_before) * share)

    own = [r for r in step_timer.records() if begun <= r.start and r.end <= ended]
    trace.events += [
        {"ph": "X", "cat": "mgtutor", "name": r.name, "pid": trace.rank, "tid": _PHASES_TID,
         "ts": to_unix(r.start), "dur": 1e6 * r.duration, "args": {"step": r.step}}
        for r in own
    ]
    trace.events.append(_thread_name(trace.rank, _PHASES_TID, "mgtutor.step() / phase()"))
    steps = [r for r in step_timer.records() if r.name == STEP]
    for c in trace.collectives():
        # From the caller's launch (where the trace holds it) to gloo's completion, as a hook
        # would time it: time queued for gloo's threads included.
        launched = c.start if c.launched is None else c.launched
        if c.start < trace.barrier_end or launched > closing:
            continue  # the barriers' own
        start, end = to_perf(launched), to_perf(c.end)
        name = c.name.split(":", 1)[1].replace("_", "")  # "all_reduce" -> "allreduce"
        step = _step_of(start, steps, step_timer)
        step_timer.add(PhaseRecord(name, step, start, end, nbytes=c.nbytes))


def _step_of(moment: float, steps: list[PhaseRecord], step_timer: StepTimer) -> int:
    """The step a moment belongs to: the step running then, else the next one to run."""
    begun = [r for r in steps if r.start <= moment]
    if not begun:
        return min((r.step for r in steps), default=step_timer.steps_done)
    last = max(begun, key=lambda r: r.start)
    return last.step if moment <= last.end else last.step + 1


def _read_events(prof: profile, rank: int) -> list[dict[str, Any]]:
    """The profile's events with ``ts`` in Unix µs, every ``pid`` this rank's."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "trace.json")
        prof.export_chrome_trace(str(path))
        exported = json.loads(path.read_text())
    # ts counts µs from baseTimeNanoseconds (torch 2.4-2.15 write it), itself Unix time.
    base = exported.get("baseTimeNanoseconds", 0) / 1000
    events = []
    for event in exported["traceEvents"]:
        if event.get("ph") == "M" and event.get("name", "").startswith("process_"):
            continue  # the OS process's name and order: write_trace names the rank instead
        event = dict(event, pid=rank)
        if "ts" in event:
            event["ts"] = float(event["ts"]) + base
        if isinstance(event.get("id"), int):  # flow ids (a launch to its kernel), per rank
            event["id"] += rank << 40
        events.append(event)
    return events


def _thread_name(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def merge_traces(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """The ranks' traces as one Chrome trace (a dict), a process per rank, on one clock.

    Args:
        traces: one :class:`RankTrace` per rank (what each rank's fn returned).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``; times in µs
        from the zero ``otherData["clock"]`` describes.

    Raises:
        ValueError: no traces, an empty one, or two of one rank.
    """
    ranks = [t.rank for t in traces]
    if not traces or len(set(ranks)) != len(ranks) or not all(t.events for t in traces):
        raise ValueError(
            f"merge_traces needs one filled RankTrace per rank, got ranks {ranks}: return the "
            "trace from fn after record_trace's block has ended"
        )
    one_machine = len({t.host for t in traces}) == 1
    if one_machine:
        zero = {t.rank: min(x.barrier_end for x in traces) for t in traces}
        clock = (
            "one machine: every rank's times as its profiler stamped them (Unix time, one "
            "system clock), zero at the earliest rank's exit from the starting barrier"
        )
    else:
        zero = {t.rank: t.barrier_end for t in traces}
        clock = (
            "several machines: each rank's times shifted so that its own exit from the "
            "starting barrier is zero"
        )
    events = []
    for t in sorted(traces, key=lambda t: t.rank):
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "tid": 0,
                       "args": {"name": f"rank {t.rank} ({t.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": t.rank, "tid": 0,
                       "args": {"sort_index": t.rank}})
        for event in t.events:
            events.append(dict(event, ts=event["ts"] - zero[t.rank]) if "ts" in event else event)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clock": clock, "ranks": sorted(ranks)},
    }


def write_trace(traces: Sequence[RankTrace], path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write :func:`merge_traces`'s file to ``path`` (open it in ui.perfetto.dev); return it."""
    merged = merge_traces(traces)
    Path(path).write_text(json.dumps(merged, separators=(",", ":")))
    return merged
