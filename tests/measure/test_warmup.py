"""Warm-up steps: counted, shown in the Run's table, kept out of the plots' scale and window."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

import mgtutor  # noqa: E402
from mgtutor.launcher.run import RankResult, Run, count_warmup  # noqa: E402
from mgtutor.measure.memory import MemoryStats  # noqa: E402
from mgtutor.measure.timing import PhaseRecord  # noqa: E402

# As a GPU ran small_cnn: step 0 about 600 ms (CUDA's context, cuDNN's algorithms), then 2 ms.
GPU_LIKE = [0.6] + [0.002] * 9


def _run(step_times: list[float], world_size: int = 2) -> Run:
    ranks = []
    for rank in range(world_size):
        timings, start = [], 0.5
        for s, duration in enumerate(step_times):
            timings += [
                PhaseRecord("forward", s, start, start + duration / 2),
                PhaseRecord("backward", s, start + duration / 2, start + duration),
                PhaseRecord("step", s, start, start + duration, samples=10),
            ]
            start += duration
        memory = MemoryStats("cpu", 100, 150)
        ranks.append(RankResult(rank, 1000 + rank, "cpu", "gloo", 1.0, memory, rank, timings))
    return Run(world_size, ranks, 2.0)


@pytest.mark.parametrize(
    ("times", "warmup"),
    [
        (GPU_LIKE, 1),
        ([0.9, 0.5, 0.01, 0.01, 0.01, 0.01], 2),  # two slow steps, then steady
        ([0.015, 0.01, 0.012, 0.01], 0),  # a CPU's usual spread: no warm-up
        ([0.01, 0.01, 0.01, 0.5, 0.5, 0.5], 0),  # it slowed down later: not warm-up
        ([0.5, 0.5, 0.5, 0.01, 0.01, 0.01, 0.01], 3),
        ([0.6], 0),
        ([], 0),
    ],
)
def test_count_warmup(times: list[float], warmup: int) -> None:
    assert count_warmup(times) == warmup


def test_the_runs_table_says_how_many_steps_were_warm_up() -> None:
    run = _run(GPU_LIKE)
    assert run.steps == 10 and run.warmup_steps == 1
    assert repr(run).splitlines()[0].endswith(", 10 steps, 1 treated as warm-up)")
    assert "10 steps, 1 treated as warm-up" in run._repr_html_()
    no_steps = Run(1, [RankResult(0, 1, "cpu", None, 0.1, MemoryStats("cpu", 1, 2), None)], 0.5)
    assert repr(no_steps).splitlines()[0] == "Run(world_size=1, wall_time=0.50 s)"


def test_plot_step_times_draws_warm_up_but_scales_to_the_steady_steps() -> None:
    ax = mgtutor.plot_step_times(_run(GPU_LIKE)).axes[0]
    ranks = [line for line in ax.get_lines() if line.get_label().startswith("rank")]
    assert list(ranks[0].get_ydata()) == pytest.approx([600] + [2] * 9)  # drawn, all of it
    assert ax.get_ylim()[1] == pytest.approx(2 * 1.15), "the axis is the steady steps'"
    assert "warm-up" in [t.get_text() for t in ax.get_legend().get_texts()]
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["above the axis:\nstep 0: 600 ms"], "once, though both ranks are off scale"
    assert "after 1 warm-up step" in ax.get_title()
    every = mgtutor.plot_step_times(_run(GPU_LIKE), scale_warmup=True).axes[0]
    assert every.get_ylim()[1] == pytest.approx(600 * 1.15)
    steady = mgtutor.plot_step_times(_run([0.1] * 4)).axes[0]
    assert "warm-up" not in steady.get_title() and steady.get_ylim()[1] == pytest.approx(115)


def test_plot_timelines_default_window_leaves_out_warm_up() -> None:
    run = _run(GPU_LIKE[:6])
    ax = mgtutor.plot_timeline(run).axes[0]
    assert ax.get_title().endswith("steps 1-5 of 6 after 1 warm-up step; steps= shows others")
    assert all(len(c.get_paths()) == 5 for c in ax.collections)
    shown = mgtutor.plot_timeline(run, steps=slice(0, 6)).axes[0]
    assert all(len(c.get_paths()) == 6 for c in shown.collections)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plot_timelines_legend_does_not_cover_its_x_axis_label(world_size: int) -> None:
    fig = mgtutor.plot_timeline(_run([0.1] * 3, world_size=world_size))
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    label = fig.axes[0].xaxis.label.get_window_extent(renderer)
    legend = (fig.legends or [fig.axes[0].get_legend()])[0].get_window_extent(renderer)
    assert not label.overlaps(legend), (label, legend)
    assert legend.y1 <= label.y0 and legend.y0 >= 0, "below the label, inside the figure"
