"""Plots of a launch: per-rank memory (and by category), a timeline of phases, step times, scaling.

Each function returns a matplotlib Figure that a notebook draws exactly once, whichever way the
cell shows it: as the cell's last value, assigned to a variable, followed by ``plt.show()`` or
given to ``display`` (:mod:`mgtutor.measure.figure` says how); a script can ``fig.savefig(...)``.
matplotlib is imported inside the functions, so workers never pay for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mgtutor.measure.timing import STEP
from mgtutor.plan.memplan import CATEGORIES, MemoryBreakdown
from mgtutor.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

__all__ = ["plot_memory", "plot_timeline", "plot_step_times", "plot_scaling"]

_MIB = 1024 * 1024
_PHASE_COLOURS = {
    "data": "#8da0cb",
    "forward": "#66c2a5",
    "backward": "#fc8d62",
    "allreduce": "#e78ac3",
    "optimizer": "#a6d854",
}


class Run(Protocol):
    """What the plots read of :class:`mgtutor.Run`, so that they need nothing of the launcher."""

    world_size: int
    ranks: Sequence[Any]  # mgtutor.RankResult: rank, device, memory, timings, breakdown

    @property
    def warmup_steps(self) -> int: ...

    def step_times(self, rank: int) -> list[float]: ...

    def throughput(self) -> float: ...


def _new_figure(width: float, height: float) -> Figure:
    from mgtutor.measure.figure import new_figure

    return new_figure(width, height)


def plot_memory(run: Run) -> Figure:
    """Bars of each rank's peak memory, labelled with what was measured.

    GPU ranks: peak allocated (live tensors) beside peak reserved (the caching allocator's
    pool). CPU ranks: the worker process's resident memory when fn started beside its peak.
    See :mod:`mgtutor.measure.memory` for exactly what each figure counts. When fn called
    :func:`mgtutor.track` on every rank, a second panel stacks each rank's bytes by category
    (parameters, gradients, optimizer state, DDP's buckets, the activations autograd saved, and
    on a GPU the rest of the allocator's peak: library workspaces and temporaries).

    Args:
        run: what :func:`mgtutor.launch` or :meth:`mgtutor.Pool.run` returned.

    Returns:
        The figure.
    """
    tracked = [r.breakdown for r in run.ranks]
    panels = 2 if tracked and all(b is not None for b in tracked) else 1
    fig = _new_figure(max(4.2, 1.6 + 1.1 * len(run.ranks)) * panels, 4.2)
    ax = fig.add_subplot(1, panels, 1)
    ranks = [r.rank for r in run.ranks]
    cuda = all(r.memory.is_cuda for r in run.ranks)
    if cuda:
        pairs = [(r.memory.peak_allocated or 0, r.memory.peak_reserved or 0) for r in run.ranks]
        labels = ("peak allocated (tensors)", "peak reserved (caching allocator)")
        title = "Peak GPU memory per rank (torch.cuda, this process only)"
    else:
        pairs = [(r.memory.rss_at_start, r.memory.peak_rss) for r in run.ranks]
        whole_life = any(r.memory.peak_rss_since_start for r in run.ranks)
        labels = (
            "resident when fn started",
            "peak resident (whole process life)" if whole_life else "peak resident while fn ran",
        )
        title = "Worker process memory per rank (RSS)"
    width = 0.38
    for i, label in enumerate(labels):
        xs = [x + (i - 0.5) * width for x in range(len(ranks))]
        values = [pair[i] / _MIB for pair in pairs]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[format_bytes(pair[i]) for pair in pairs], fontsize=7)
    ax.set_xticks(range(len(ranks)), [f"rank {r.rank}\n{r.device}" for r in run.ranks])
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.margins(y=0.15)
    if panels == 2:
        plot_breakdown(
            {r.rank: b for r, b in zip(run.ranks, tracked)},
            ax=fig.add_subplot(1, 2, 2),
            title="What the tracked model and optimizer hold, by category",
        )
    return fig


# Steps plot_timeline shows when not told: more are a smear of thin bars at this width.
TIMELINE_STEPS = 6


def plot_timeline(run: Run, *, steps: slice | None = None) -> Figure:
    """One row per rank, each timed phase a coloured bar on the launch's time axis.

    Phases come from :func:`mgtutor.phase` (and "allreduce" from
    :meth:`mgtutor.StepTimer.watch_allreduce`); all-reduce bars are drawn as a thin band in the
    lower part of the row, because under DDP they overlap the backward pass; the moments
    :meth:`mgtutor.StepTimer.watch_gradients` records are thin ticks. Shorter phases are drawn
    over longer ones, so a phase timed inside another stays visible.

    Args:
        run: what :func:`mgtutor.launch` returned.
        steps: only these steps (for example ``slice(0, 5)``; ``slice(None)`` for all). By
            default the last ``TIMELINE_STEPS`` (6) and none of the warm-up steps
            (:attr:`mgtutor.Run.warmup_steps`): the steady state. The title says which steps of
            how many are shown.

    Returns:
        The figure.

    Raises:
        ValueError: when no rank recorded any phase.
    """
    records = {r.rank: [p for p in r.timings if p.name != STEP] for r in run.ranks}
    total = 1 + max((p.step for ps in records.values() for p in ps), default=0)
    chosen = steps is not None
    warmup = run.warmup_steps
    if steps is None:
        steps = slice(max(warmup, total - TIMELINE_STEPS), total)
    wanted = range(*steps.indices(total))
    records = {k: [p for p in ps if p.step in wanted] for k, ps in records.items()}
    if not any(records.values()):
        raise ValueError(
            "no phases were recorded: inside fn wrap work in `with mgtutor.phase('forward'):`"
        )
    fig = _new_figure(9, 0.9 + 0.6 * run.world_size)
    ax = fig.add_subplot()
    names: list[str] = []
    for phases in records.values():
        for p in phases:
            if p.name not in names:
                names.append(p.name)
    # Long phases first, so a phase timed inside another (an all-reduce inside backward, a
    # SyncBatchNorm exchange inside forward) is drawn on top of it rather than hidden.
    legend_order = list(names)
    mean = {
        n: sum(p.duration for ps in records.values() for p in ps if p.name == n)
        / max(1, sum(1 for ps in records.values() for p in ps if p.name == n))
        for n in names
    }
    names.sort(key=lambda n: (n == "gradient", n == "allreduce", -mean[n]))
    cycle = ["#b3b3b3", "#ffd92f", "#e5c494", "#1b9e77", "#7570b3"]
    colours = {n: _PHASE_COLOURS.get(n, cycle[i % len(cycle)]) for i, n in enumerate(names)}
    origin = min(p.start for phases in records.values() for p in phases)
    for rank, phases in records.items():
        for name in names:
            spans = [((p.start - origin) * 1e3, p.duration * 1e3) for p in phases if p.name == name]
            if not spans:
                continue
            label = name if rank == 0 else None
            if name == "gradient":  # instants (StepTimer.watch_gradients): a tick each
                ticks = [start for start, _ in spans]
                ax.vlines(ticks, rank - 0.4, rank + 0.4, colors="#333333", lw=0.6, label=label)  # type: ignore[arg-type]  # None: no legend entry
                continue
            y, h = (rank - 0.4, 0.8) if name != "allreduce" else (rank + 0.1, 0.3)
            ax.broken_barh(spans, (y, h), facecolors=colours[name], label=label)
    ax.set_yticks(list(records), [f"rank {r}" for r in records])
    ax.invert_yaxis()
    ax.set_xlabel("time since the first timed phase shown (ms)")
    if len(wanted) == total:
        shown = f"all {total} steps" if total > 1 else "the run"
    else:
        first, last = wanted[0], wanted[-1]
        shown = f"step{'s' if len(wanted) > 1 else ''} {first}" + (
            f"-{last}" if len(wanted) > 1 else ""
        )
        shown += f" of {total}"
        if not chosen and warmup and first == warmup:
            shown += f" after {warmup} warm-up step{'s' if warmup > 1 else ''}"
        shown += "" if chosen else "; steps= shows others"
    ax.set_title(f"What each rank was doing: {shown}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    found = dict(zip(labels, handles))
    unique = {n: found[n] for n in legend_order if n in found}
    # Below the whole axes, x-axis label included: the constrained layout makes room for it.
    fig.legend(
        unique.values(),
        unique.keys(),
        fontsize=8,
        ncols=len(unique),
        loc="outside lower center",
        frameon=False,
    )
    return fig


def plot_step_times(run: Run, *, scale_warmup: bool = False) -> Figure:
    """Step time per rank, step by step (from ``mgtutor.step()`` records).

    The warm-up steps (:attr:`mgtutor.Run.warmup_steps`: a first GPU step can take 300 times
    a later one) are shaded and drawn, but the time axis is scaled to the steps after them; a
    warm-up point above the axis is drawn at its top edge, one label listing their times.

    Args:
        run: what :func:`mgtutor.launch` returned.
        scale_warmup: scale the axis to every step, warm-up included.

    Returns:
        The figure.

    Raises:
        ValueError: when no rank recorded steps.
    """
    fig = _new_figure(7, 3.4)
    ax = fig.add_subplot()
    series = {r.rank: [t * 1e3 for t in run.step_times(r.rank)] for r in run.ranks}
    series = {rank: times for rank, times in series.items() if times}
    if not series:
        raise ValueError(
            "no steps were recorded: inside fn wrap each step in `with mgtutor.step():`"
        )
    warmup = run.warmup_steps
    steady = [t for times in series.values() for t in times[warmup:]]
    top = max(steady if not scale_warmup and steady else [t for ts in series.values() for t in ts])
    top *= 1.15
    off_scale: dict[int, float] = {}
    for rank, times in series.items():
        (line,) = ax.plot(range(len(times)), times, marker=".", label=f"rank {rank}")
        for step, t in enumerate(times[:warmup]):
            if t > top:  # off the scale: a hollow marker on the top edge
                ax.plot(step, top, marker="^", mfc="none", color=line.get_color(), clip_on=False)
                off_scale[step] = max(t, off_scale.get(step, 0.0))
    if off_scale:  # the slowest rank's time per step, in one label: neighbours' would overlap
        ordered = sorted(off_scale.items())  # a step may go off the scale on rank 1 only
        lines = ["above the axis:"] + [f"step {s}: {t:.0f} ms" for s, t in ordered]
        box = {"facecolor": "white", "edgecolor": "#999", "alpha": 0.9}
        ax.annotate("\n".join(lines), (max(off_scale), top), (8, -4), "data", "offset points",
                    va="top", fontsize=7, bbox=box)  # fmt: skip
    if warmup:
        ax.axvspan(-0.5, warmup - 0.5, color="#dddddd", zorder=0, label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(0, top)
    title = "Step time per rank"
    if warmup and not scale_warmup:
        title += f" (axis scaled to the steps after {warmup} warm-up step{'s' * (warmup > 1)})"
    ax.set_title(title, fontsize=10)
    # Outside the axes, on the right: inside, "best" may sit on the label of the off-scale steps.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return fig


def plot_scaling(runs: Sequence[Run]) -> Figure:
    """Throughput against world size, with the ideal line and each run's efficiency in %.

    The ideal is the smallest world size's throughput per rank times the world size; the
    efficiency is measured throughput over that ideal.

    Args:
        runs: launches of the same work at different world sizes, each with
            ``mgtutor.step(samples=...)`` records.

    Returns:
        The figure.

    Raises:
        ValueError: fewer than one run, or runs without samples in their step records.
    """
    if not runs:
        raise ValueError("plot_scaling needs at least one Run")
    points = sorted((run.world_size, run.throughput()) for run in runs)
    base_size, base_rate = points[0]
    per_rank = base_rate / base_size
    fig = _new_figure(6, 4)
    ax = fig.add_subplot()
    sizes = [s for s, _ in points]
    ax.plot(sizes, [per_rank * s for s in sizes], "--", color="grey", label="ideal (linear)")
    ax.plot(sizes, [t for _, t in points], "o-", label="measured")
    for size, rate in points:
        ax.annotate(
            f"{100 * rate / (per_rank * size):.0f}%",
            (size, rate),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=8,
        )
    ax.set_xticks(sizes)
    ax.margins(x=0.12)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("samples / s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title("Scaling: throughput and efficiency", fontsize=10)
    ax.legend(fontsize=8)
    return fig


_COLOURS = {
    "parameters": "#66c2a5",
    "gradients": "#fc8d62",
    "optimizer_state": "#8da0cb",
    "communication": "#e78ac3",
    "activations": "#ffd92f",
    "rest_of_peak": "#b3b3b3",
}
_LABELS = {"rest_of_peak": "rest of the peak (workspaces, temporaries)"}


def plot_breakdown(
    breakdowns: Sequence[MemoryBreakdown]
    | Mapping[int, MemoryBreakdown]
    | Mapping[str, Sequence[MemoryBreakdown]],
    *,
    title: str = "Memory by category per rank",
    ax: Axes | None = None,
) -> Figure | SubFigure:
    """One stacked bar per rank: parameters, gradients, optimizer state, communication, ...

    Activations are stacked where they were measured (by :func:`mgtutor.track`), the rest of
    the allocator's peak on GPU ranks; on a GPU the stack is the peak. An estimate's
    ``transient`` bytes (FSDP's unit, gathered, with its gradients) are drawn hatched on top.

    Args:
        breakdowns: a list indexed by rank, a dict by rank, or a dict from a label (say
            "DDP", "FSDP") to such a list, drawn as groups side by side.
        title: the plot's title.
        ax: draw on these axes (say, beside :func:`mgtutor.plot_memory`'s bars) instead of on
            a new figure.

    Returns:
        The figure (the one holding ``ax`` when it is given).

    Raises:
        ValueError: when there is nothing to draw.
    """

    bars: list[tuple[str, MemoryBreakdown]] = []
    if isinstance(breakdowns, Mapping):
        for key, value in breakdowns.items():
            if isinstance(value, MemoryBreakdown):
                bars.append((f"rank {key}", value))
            else:
                bars.extend((f"{key}\nrank {r}", b) for r, b in enumerate(value))
    else:
        bars = [(f"rank {r}", b) for r, b in enumerate(breakdowns)]
    if not bars:
        raise ValueError("no breakdowns to plot: pass a list of MemoryBreakdown, one per rank")
    if ax is None:
        ax = _new_figure(max(5.5, 1.8 + 1.0 * len(bars)), 4.4).add_subplot()
    unit, scale = _unit_for(max(b.total for _, b in bars))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for name in CATEGORIES:
        values = [(getattr(b, name) or 0) / scale for _, b in bars]
        if not any(values):
            continue
        label = _LABELS.get(name, name.replace("_", " "))
        ax.bar(xs, values, 0.6, bottom=bottom, label=label, color=_COLOURS[name])
        bottom = [b + v for b, v in zip(bottom, values)]
    transient = [(b.transient or 0) / scale for _, b in bars]
    if any(transient):
        drawn = [x for x in xs if transient[x]]  # no empty outlined box where there is none
        ax.bar(
            drawn,
            [transient[x] for x in drawn],
            0.6,
            bottom=[bottom[x] for x in drawn],
            label="transient (unit gathered, with its gradients)",
            color="white",
            edgecolor="#555555",
            hatch="//",
        )
        bottom = [b + v for b, v in zip(bottom, transient)]
    for x, (_, b) in zip(xs, bars):
        text = format_bytes(b.total) + (f"\n+{format_bytes(b.transient)}" if b.transient else "")
        ax.annotate(text, (x, bottom[x]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    # Room above the tallest bar for its label (two lines with a transient): margins alone
    # were not kept once the hatched bars were drawn, and the labels ran into the title.
    ax.set_ylim(0, max(bottom) * (1.25 if any(transient) else 1.15))
    return ax.figure


def _unit_for(largest: int) -> tuple[str, float]:
    for unit, scale in (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0
