"""The all-reduce bandwidth benchmark: its arithmetic, its table and its command line."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import matplotlib
import pytest

matplotlib.use("Agg")

from mgtutor import bench  # noqa: E402


def test_sweep_reports_nccl_tests_conventions() -> None:
    result = bench.measure_allreduce(2, [4096, 1024, 65536])
    assert [p.size for p in result.points] == [1024, 4096, 65536]
    assert (result.world_size, result.backend, result.device) == (2, "gloo", "cpu")
    for p in result.points:
        assert p.seconds > 0
        assert p.algbw == pytest.approx(p.size / p.seconds)
        assert p.busbw == pytest.approx(p.algbw * 2 * (2 - 1) / 2)
        # The loop's calls, on its own clock, within the clock read around the loop.
        assert p.iterations is not None and p.loop_seconds is not None
        assert 0 < p.seconds * p.iterations <= p.loop_seconds * (1 + 1e-9)
    assert result.copy_bandwidth > 0 and result.copy_size == 65536
    table = result.table()
    assert "| 64 KiB |" in table and "memory copy of 64 KiB" in table
    ax = bench.plot_bandwidth(result).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()][1].startswith("bus bandwidth")


def test_profiled_sweep_times_a_separate_repeat_with_a_second_clock() -> None:
    # The plain loop gives seconds; the profiled repeat's own clock and the profiler's events
    # time the same calls, which add only the call's own overhead (Python, the wake-up of the
    # waiting thread): generous bounds, for a busy machine. Either order of the two loops.
    for first in (False, True):
        result = bench.measure_allreduce(2, [4096, 2**20], profile=True, profile_first=first)
        for p in result.points:
            assert p.seconds > 0 and p.profiled is not None and p.profiled > 0
            assert p.under_profiler is not None
            assert 0.9 * p.profiled <= p.under_profiler <= 3 * p.profiled + 1e-3
    plain = bench.measure_allreduce(2, [4096]).points
    assert all(p.profiled is None and p.under_profiler is None for p in plain)


def test_memory_copy_is_measured_in_rank_zero_not_in_the_calling_process() -> None:
    # On GPUs a copy here would initialize CUDA in the notebook's own process.
    refuse = AssertionError("the memory copy ran in the calling process")
    with mock.patch.object(bench, "_copy_bandwidth", side_effect=refuse):
        result = bench.measure_allreduce(2, [4096])
    assert result.copy_bandwidth > 0 and result.copy_size == 4096


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 4"):
        bench.measure_allreduce(2, [1023])
    with pytest.raises(ValueError, match="multiples of 4"):
        bench.measure_allreduce(2, [])
    assert bench._parse_size("64M") == 64 * 2**20 and bench._parse_size("1KiB") == 1024


def test_command_line(tmp_path, capsys) -> None:
    # main() in this process (a new interpreter would import torch again: about 8 s here); the
    # module's `python -m` entry runs below, on arguments it refuses before launching anything.
    plot = tmp_path / "bw.png"
    assert bench.main(["--max-size", "16K", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "| 16 KiB |" in out and "| 1 KiB |" in out
    assert plot.stat().st_size > 1000
    bad = subprocess.run(
        [sys.executable, "-m", "mgtutor.bench", "--min-size", "1M", "--max-size", "1K"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "larger than --max-size" in bad.stderr
