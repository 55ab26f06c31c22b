"""Phase timing in one process and under DDP, and the four plots."""

from __future__ import annotations

import time

import matplotlib
import pytest

matplotlib.use("Agg")

import mgtutor  # noqa: E402
from mgtutor.launcher.run import RankResult, Run  # noqa: E402
from mgtutor.measure.memory import MemoryStats  # noqa: E402
from mgtutor.measure.timing import PhaseRecord, StepTimer  # noqa: E402


def test_step_timer_records_phases_and_steps() -> None:
    t = StepTimer("cpu")
    for _ in range(2):
        with t.step(samples=4):
            with t.phase("forward"):
                time.sleep(0.01)
            with t.phase("backward"):
                time.sleep(0.02)
    records = t.records()
    assert [(r.name, r.step) for r in records] == [
        ("forward", 0),
        ("backward", 0),
        ("step", 0),
        ("forward", 1),
        ("backward", 1),
        ("step", 1),
    ]
    steps = [r for r in records if r.name == "step"]
    assert all(r.samples == 4 and r.duration >= 0.03 for r in steps)
    assert records[1].start >= records[0].end


def test_disabled_timer_records_nothing() -> None:
    t = StepTimer("cpu", enabled=False)
    with t.step(samples=1), t.phase("forward"):
        pass
    assert t.records() == []


def test_watch_allreduce_times_ddp_buckets_and_keeps_ddp_gradients() -> None:
    def work(watch: bool) -> tuple:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        mgtutor.setup()
        torch.manual_seed(0)
        model = DDP(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)), bucket_cap_mb=0.01
        )
        if watch:
            mgtutor.timer().watch_allreduce(model)
        torch.manual_seed(1 + dist.get_rank())
        for _ in range(3):
            with mgtutor.step(samples=8), mgtutor.phase("backward"):
                model(torch.randn(8, 64)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    watched = mgtutor.launch(work, True, world_size=2)
    plain = mgtutor.launch(work, False, world_size=2)
    for a, b in zip(watched.results[0], plain.results[0]):
        assert (a == b).all(), "the timing hook must reduce exactly like DDP's default"
    reduces = [p for p in watched.timings[0] if p.name == "allreduce"]
    param_bytes = 4 * (64 * 64 + 64 + 64 * 2 + 2)
    for step in range(3):
        in_step = [p for p in reduces if p.step == step]
        assert in_step and sum(p.nbytes for p in in_step) == param_bytes
        assert all(p.end >= p.start for p in in_step)
    assert not [p for p in plain.timings[0] if p.name == "allreduce"]
    fig = mgtutor.plot_timeline(watched)
    assert "allreduce" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_watch_gradients_shows_an_all_reduce_launched_before_the_last_gradient() -> None:
    # Steps 0-2: buckets of 0.01 MiB; steps 3-5: the default buckets, one bucket for this model
    # from the rebuild on. Only small buckets can launch before backward wrote the last gradient.
    def work() -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        mgtutor.setup()
        for cap in (0.01, None):
            torch.manual_seed(0)
            layers = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)]
            model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=cap)
            mgtutor.timer().watch_allreduce(model)
            mgtutor.timer().watch_gradients(model)
            for _ in range(3):
                with mgtutor.step(samples=8):
                    model(torch.randn(8, 64)).sum().backward()

    run = mgtutor.launch(work, world_size=2)
    records = run.timings[0]

    def first_launch_before_last_gradient(step: int) -> bool:
        launches = [p.start for p in records if p.name == "allreduce" and p.step == step]
        gradients = [p for p in records if p.name == "gradient" and p.step == step]
        assert len(gradients) == 6
        assert sum(p.nbytes for p in gradients) == 4 * (2 * 64 * 65 + 2 * 65)
        assert all(p.start == p.end for p in gradients)
        return min(launches) < max(p.start for p in gradients)

    assert [first_launch_before_last_gradient(step) for step in range(1, 6)] == [
        True,  # small buckets: the last layers' bucket goes before the first layer's gradients
        True,
        False,  # step 3: every parameter in one bucket, launched after the last gradient
        False,
        False,
    ]
    legend = mgtutor.plot_timeline(run).legends[0].get_texts()
    assert "gradient" in [t.get_text() for t in legend]


def _fake_run(world_size: int, cuda: bool = False, step_s: float = 0.1, steps: int = 3) -> Run:
    ranks = []
    for rank in range(world_size):
        memory = MemoryStats(
            device=f"cuda:{rank}" if cuda else "cpu",
            rss_at_start=100 * 2**20,
            peak_rss=150 * 2**20,
            peak_allocated=2**30 if cuda else None,
            peak_reserved=2**31 if cuda else None,
        )
        timings = []
        for s in range(steps):
            start = 0.5 + s * step_s
            timings += [
                PhaseRecord("forward", s, start, start + step_s / 2),
                PhaseRecord("backward", s, start + step_s / 2, start + step_s),
                PhaseRecord("step", s, start, start + step_s, samples=10),
            ]
        ranks.append(
            RankResult(rank, 1000 + rank, memory.device, "gloo", 1.0, memory, rank, timings)
        )
    return Run(world_size, ranks, 2.0)


def test_plot_memory_labels_what_was_measured() -> None:
    fig = mgtutor.plot_memory(_fake_run(2))
    ax = fig.axes[0]
    assert "RSS" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "resident when fn started",
        "peak resident while fn ran",
    ]
    assert len(ax.patches) == 4
    assert sorted(p.get_height() for p in ax.patches) == [100, 100, 150, 150]
    gpu = mgtutor.plot_memory(_fake_run(2, cuda=True)).axes[0]
    assert "peak reserved (caching allocator)" in [
        t.get_text() for t in gpu.get_legend().get_texts()
    ]
    assert sorted(p.get_height() for p in gpu.patches) == [1024, 1024, 2048, 2048]


def test_plot_timeline_and_step_times() -> None:
    run = _fake_run(3)
    ax = mgtutor.plot_timeline(run).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert len(ax.collections) == 6  # forward and backward bars for each rank
    only_first = mgtutor.plot_timeline(run, steps=slice(0, 1)).axes[0]
    assert all(len(c.get_paths()) == 1 for c in only_first.collections)
    assert only_first.get_title().endswith("step 0 of 3")
    nested = Run(
        1,
        [
            RankResult(
                0,
                1,
                "cpu",
                "gloo",
                1.0,
                run.ranks[0].memory,
                None,
                [PhaseRecord("forward", 0, 0.0, 1.0), PhaseRecord("exchange", 0, 0.4, 0.5)],
            )
        ],
        2.0,
    )
    drawn = [c.get_label() for c in mgtutor.plot_timeline(nested).axes[0].collections]
    assert drawn == ["forward", "exchange"], "the nested, shorter phase is drawn on top"
    lines = mgtutor.plot_step_times(run).axes[0].get_lines()
    assert len(lines) == 3 and list(lines[0].get_ydata()) == pytest.approx([100, 100, 100])


def test_plot_scaling_shows_ideal_and_efficiency() -> None:
    one, two = _fake_run(1, step_s=0.1), _fake_run(2, step_s=0.125)
    assert one.throughput() == pytest.approx(100)
    assert two.throughput() == pytest.approx(160)
    ax = mgtutor.plot_scaling([two, one]).axes[0]
    ideal, measured = ax.get_lines()
    assert list(ideal.get_ydata()) == pytest.approx([100, 200])
    assert list(measured.get_ydata()) == pytest.approx([100, 160])
    assert [t.get_text() for t in ax.texts] == ["100%", "80%"]


def test_plots_without_records_say_what_to_add() -> None:
    empty = Run(1, [RankResult(0, 1, "cpu", None, 0.1, MemoryStats("cpu", 1, 2), None, [])], 0.5)
    with pytest.raises(ValueError, match="mgtutor.phase"):
        mgtutor.plot_timeline(empty)
    with pytest.raises(ValueError, match="mgtutor.step"):
        mgtutor.plot_step_times(empty)
    with pytest.raises(ValueError, match="samples"):
        mgtutor.plot_scaling([empty])
    with pytest.raises(ValueError, match="at least one Run"):
        mgtutor.plot_scaling([])


def test_plot_timeline_shows_the_last_steps_by_default_and_says_so() -> None:
    run = _fake_run(2, steps=50)
    ax = mgtutor.plot_timeline(run).axes[0]
    assert ax.get_title().endswith("steps 44-49 of 50; steps= shows others")
    assert all(len(c.get_paths()) == 6 for c in ax.collections)  # one bar per step shown
    every = mgtutor.plot_timeline(run, steps=slice(None)).axes[0]
    assert every.get_title().endswith("all 50 steps")
    assert all(len(c.get_paths()) == 50 for c in every.collections)


def test_off_scale_warmup_labels_do_not_overlap() -> None:
    # 00's run: 64 steps, the first two far slower than the rest, neighbours on a 7-inch axis.
    timings = []
    for s, seconds in enumerate([1.2, 0.6] + [0.01] * 62):
        start = sum([1.2, 0.6] + [0.01] * 62)  # any start; only durations are drawn
        timings.append(PhaseRecord("step", s, start, start + seconds, samples=32))
    memory = MemoryStats(device="cpu", rss_at_start=1, peak_rss=2)
    run = Run(1, [RankResult(0, 1, "cpu", "gloo", 1.0, memory, None, timings)], 2.0)
    assert run.warmup_steps == 2
    fig = mgtutor.plot_step_times(run)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [t for t in ax.texts if "ms" in t.get_text()]
    text = " ".join(t.get_text() for t in labels)
    assert "1200 ms" in text and "600 ms" in text, "each off-scale step's time is written"
    boxes = [t.get_window_extent(renderer) for t in labels]
    boxes.append(ax.get_legend().get_window_extent(renderer))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), f"labels overlap: {a} and {b}"
