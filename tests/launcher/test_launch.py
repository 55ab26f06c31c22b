"""mgtutor.launch on the CPU path: results, the environment contract, output relay, records."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import mgtutor
from tests.helpers import worker_children

# Every launcher promise holds on both start methods: each test runs once per method.
pytestmark = pytest.mark.usefixtures("start_method")

REPO = Path(__file__).resolve().parents[2]


def cell_function(source: str, name: str):
    """Define a function the way a notebook cell does: in __main__, with no file to import."""
    namespace = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(source), "/tmp/ipykernel_0/cell.py", "exec"), namespace)
    return namespace[name]


def test_results_come_back_in_rank_order() -> None:
    run = mgtutor.launch(lambda base: base + int(os.environ["RANK"]), 100, world_size=3)
    assert run.results == [100, 101, 102]
    assert [r.rank for r in run.ranks] == [0, 1, 2]
    assert len({r.pid for r in run.ranks}) == 3


def test_launch_is_a_pools_one_call_whose_arguments_are_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mgtutor.launcher import _arguments

    checked = []
    real = _arguments.check_arguments

    def counting(*given: object) -> None:
        checked.append(given)
        real(*given)

    monkeypatch.setattr(_arguments, "check_arguments", counting)
    monkeypatch.delenv("MGTUTOR_BACKEND", raising=False)
    assert mgtutor.launch(lambda: 7, world_size=1, start_timeout=60).results == [7]
    assert checked == [(1, None, 60, None)]


def test_cell_defined_function_closure_and_kwargs() -> None:
    work = cell_function(
        """
        def work(factor, *, offset):
            import os
            return factor * int(os.environ["RANK"]) + offset
        """,
        "work",
    )
    scale = 7

    def closure() -> int:
        return scale * 2

    assert mgtutor.launch(work, 3, offset=1, world_size=2).results == [1, 4]
    assert mgtutor.launch(closure, world_size=2).results == [14, 14]


def test_environment_contract_and_parent_environment_untouched() -> None:
    before = dict(os.environ)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def read_env() -> dict:
        return {k: os.environ.get(k) for k in names}

    first = mgtutor.launch(read_env, world_size=2).results
    second = mgtutor.launch(read_env, world_size=2).results
    assert dict(os.environ) == before
    for rank, env in enumerate(first):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
    assert first[0]["MASTER_PORT"] == first[1]["MASTER_PORT"]
    assert first[0]["MASTER_PORT"] != second[0]["MASTER_PORT"], "each launch finds a new port"


def test_setup_joins_gloo_on_cpu_and_all_reduce_works() -> None:
    def work() -> tuple:
        import torch
        import torch.distributed as dist

        device = mgtutor.setup()
        again = mgtutor.setup()  # harmless second call
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return str(device), str(again), dist.get_backend(), t.item(), torch.get_num_threads()

    run = mgtutor.launch(work, world_size=2)
    cores = len(os.sched_getaffinity(0))
    for device, again, backend, total, threads in run.results:
        assert (device, again, backend, total) == ("cpu", "cpu", "gloo", 3.0)
        assert threads == max(1, cores // 2)
    assert run.backend == "gloo"
    assert [r.device for r in run.ranks] == ["cpu", "cpu"]


def test_the_notebooks_mgtutor_backend_reaches_the_ranks_unless_a_backend_is_named(
    monkeypatch,
) -> None:
    # What keeps CPU-only work on gloo on a machine with a GPU per rank (conftest sets it).
    def seen() -> str | None:
        return os.environ.get("MGTUTOR_BACKEND")

    monkeypatch.setenv("MGTUTOR_BACKEND", "gloo")
    assert mgtutor.launch(seen, world_size=1).results == ["gloo"]
    monkeypatch.setenv("MGTUTOR_BACKEND", "nccl")
    if torch.cuda.device_count() == 0:
        with pytest.raises(mgtutor.ArgumentError, match="nccl"):  # refused before any start
            mgtutor.launch(seen, world_size=1)
    assert mgtutor.launch(seen, world_size=1, backend="gloo").results == ["gloo"]
    monkeypatch.setenv("MGTUTOR_BACKEND", "gpu")
    with pytest.raises(mgtutor.ArgumentError, match="MGTUTOR_BACKEND='gpu'"):
        mgtutor.Pool(world_size=1)
    monkeypatch.delenv("MGTUTOR_BACKEND")
    assert mgtutor.launch(seen, world_size=1).results == [None]


def test_process_group_is_destroyed_when_fn_returns() -> None:
    def work() -> bool:
        import atexit

        import torch.distributed as dist

        mgtutor.setup()
        # Runs at interpreter exit, after mgtutor's teardown; reports through a file.
        path = f"{os.environ['MGTUTOR_TEST_DIR']}/rank{dist.get_rank()}"
        atexit.register(lambda: Path(path).write_text(str(dist.is_initialized())))
        return True

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MGTUTOR_TEST_DIR"] = tmp
        try:
            mgtutor.launch(work, world_size=2)
        finally:
            del os.environ["MGTUTOR_TEST_DIR"]
        assert [Path(tmp, f"rank{r}").read_text() for r in range(2)] == ["False", "False"]


def test_output_is_relayed_in_whole_prefixed_lines(capfd) -> None:
    def noisy() -> None:
        import os
        import sys

        rank = int(os.environ["RANK"])
        for i in range(150):
            line = f"r{rank}-line{i:03d}-" + "x" * 700 + "\n"
            # Written in pieces at the descriptor level, as C++ code and NCCL do.
            for piece in (line[:13], line[13:400], line[400:]):
                os.write(1, piece.encode())
        print(f"to stderr from {rank}", file=sys.stderr)
        os.write(2, b"no newline at the end")

    mgtutor.launch(noisy, world_size=2)
    out, err = capfd.readouterr()
    pattern = re.compile(r"^\[rank (\d)\] r(\d)-line(\d{3})-x{700}$")
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in out.splitlines():
        match = pattern.match(line)
        assert match, f"a relayed line was mixed or cut: {line[:80]!r}"
        assert match[1] == match[2]
        seen[int(match[1])].append(int(match[3]))
    assert seen == {0: list(range(150)), 1: list(range(150))}
    for rank in (0, 1):
        assert f"[rank {rank}] to stderr from {rank}" in err.splitlines()
    assert err.count("] no newline at the end") == 2


class _TimedStdout:
    """A stdout that notes when each write arrived."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, str]] = []

    def write(self, text: str) -> None:
        self.stamps.append((time.perf_counter(), text))

    def flush(self) -> None:
        pass


def test_output_arrives_while_the_worker_runs(monkeypatch) -> None:
    stdout = _TimedStdout()

    def slow() -> None:
        print("early", flush=True)
        time.sleep(1.5)
        print("late", flush=True)

    monkeypatch.setattr(sys, "stdout", stdout)
    mgtutor.launch(slow, world_size=1)
    monkeypatch.undo()
    times = {text.split()[-1]: t for t, text in stdout.stamps}
    assert times["late"] - times["early"] > 1.0, "lines must be relayed live, not at the end"


def test_lines_redrawn_with_carriage_returns_show_while_they_are_drawn(monkeypatch) -> None:
    stdout = _TimedStdout()

    def bar() -> None:  # what tqdm does: redraw one line, a newline only at the end
        import sys

        for i in range(1, 21):
            sys.stdout.write(f"\rstep {i:2d}/20")
            sys.stdout.flush()
            time.sleep(0.1)
        sys.stdout.write("\n")

    monkeypatch.setattr(sys, "stdout", stdout)
    mgtutor.launch(bar, world_size=1)
    monkeypatch.undo()
    shown = [(t, text) for t, text in stdout.stamps if "step" in text]
    assert shown[-1][1] == "[rank 0] step 20/20\n"
    assert all("\r" not in text for _, text in shown)
    assert shown[-1][0] - shown[0][0] > 1.0, "the bar must show while it is drawn"
    assert 3 <= len(shown) <= 10, shown  # redrawn about twice a second, not 20 times
    assert len({text for _, text in shown}) == len(shown), "no drawing is repeated"


def test_many_lines_and_large_results_arrive_whole(capfd) -> None:
    def chatty() -> object:
        import torch

        rank = int(os.environ["RANK"])
        for i in range(30_000):
            print(f"r{rank} {i}")
        return torch.full((16 * 2**20,), float(rank))  # 64 MiB of float32

    run = mgtutor.launch(chatty, world_size=2)
    out = capfd.readouterr().out.splitlines()
    for rank in (0, 1):
        mine = [line for line in out if line.startswith(f"[rank {rank}] r{rank} ")]
        assert [int(line.split()[-1]) for line in mine] == list(range(30_000))
    for rank, result in enumerate(run.results):
        assert result.numel() * result.element_size() == 64 * 2**20
        assert bool((result == rank).all())


@pytest.mark.any_start_method
def test_tracebacks_show_the_newest_cells_first(monkeypatch) -> None:
    import importlib
    import linecache

    launch_module = importlib.import_module("mgtutor.launcher._send")

    monkeypatch.setattr(launch_module, "_MAX_SOURCE_BYTES", 10_000)
    monkeypatch.setattr(linecache, "cache", dict(linecache.cache))
    for i in range(20):  # an old session's cells, more than the limit holds
        linecache.cache[f"<old cell {i}>"] = (1000, None, ["x" * 999 + "\n"], f"<old cell {i}>")
    linecache.cache["<newest cell>"] = (9, None, ["y = 1\n"], "<newest cell>")
    sources = launch_module.cell_sources()
    assert "<newest cell>" in sources
    assert "<old cell 19>" in sources and "<old cell 0>" not in sources
    assert sum(len(line) for lines in sources.values() for line in lines) <= 10_000


@pytest.mark.any_start_method
def test_submodules_are_attributes_after_a_plain_import() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import mgtutor; print(mgtutor.data.SyntheticImages.__name__)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SyntheticImages"


@pytest.mark.any_start_method
def test_progress_falls_back_to_text_outside_a_notebook(capsys) -> None:
    def work() -> None:
        for i in range(1, 11):
            time.sleep(0.12)
            mgtutor.progress(i, 10, desc="epoch")

    mgtutor.launch(work, world_size=2)
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] epoch: 10/10 (100%)" in out
        tenths = re.findall(rf"\[rank {rank}\] epoch: (\d+)/10", out)
        assert tenths == sorted(tenths, key=int) and len(tenths) >= 5


@pytest.mark.any_start_method
def test_progress_outside_any_launch_prints_text(capsys) -> None:
    desc = f"alone-{time.monotonic_ns()}"  # progress limits its rate per description
    mgtutor.progress(5, 10, desc=desc)
    assert f"{desc}: 5/10 (50%)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="total must be positive"):
        mgtutor.progress(1, 0)


@pytest.mark.any_start_method
def test_timing_records_and_run_display() -> None:
    def work() -> str:
        mgtutor.setup()
        for _ in range(3):
            with mgtutor.step(samples=16):
                with mgtutor.phase("forward"):
                    time.sleep(0.02)
                with mgtutor.phase("backward"):
                    time.sleep(0.03)
        return "x" * 200

    run = mgtutor.launch(work, world_size=2)
    for rank in (0, 1):
        steps = run.step_times(rank)
        assert len(steps) == 3 and all(s >= 0.05 for s in steps)
        totals = run.phase_totals(rank)
        assert totals["forward"] >= 0.06 and totals["backward"] >= 0.09
        assert all(0 < p.start < p.end < run.wall_time_s for p in run.timings[rank])
    assert 2 * 3 * 16 / (0.05 * 3) * 0.3 < run.throughput() < 2 * 3 * 16 / (0.05 * 3)
    text = repr(run)
    assert "world_size=2" in text and re.search(r"^\s+1\s+cpu\s+gloo", text, re.M)
    assert "..." in text, "long results are shortened"
    html = run._repr_html_()
    assert html.count("<tr>") == 3 and "peak memory" in html


@pytest.mark.any_start_method
def test_memory_figures_see_a_large_tensor() -> None:
    def work() -> None:
        # torch is a global here, as in a notebook: it is imported before fn starts.
        if int(os.environ["RANK"]) == 1:
            big = torch.ones(64 * 1024 * 1024)  # 256 MiB of float32
            big.add_(1)

    run = mgtutor.launch(work, world_size=2)
    grown = [r.memory.peak_rss - r.memory.rss_at_start for r in run.ranks]
    assert grown[1] > 200 * 2**20
    assert grown[0] < 100 * 2**20
    assert all(not r.memory.is_cuda for r in run.ranks)


@pytest.mark.any_start_method
def test_rendezvous_listens_on_loopback_only() -> None:
    def listening() -> list[str]:
        import psutil
        import torch.distributed as dist

        mgtutor.setup()
        dist.barrier()
        found = []
        parent = psutil.Process(os.getppid())
        for proc in [parent, *parent.children(recursive=True)]:
            try:
                conns = proc.net_connections("inet")
            except psutil.Error:
                continue
            found += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
        dist.barrier()
        return found

    addresses = mgtutor.launch(listening, world_size=2).results[0]
    assert addresses, "rank 0's rendezvous store should be listening"
    assert set(addresses) <= {"127.0.0.1", "::1"}


@pytest.mark.any_start_method  # the script below names both start methods itself
def test_script_without_main_guard_runs_its_top_level_once(tmp_path: Path) -> None:
    # The script is a new process: the start_method fixture cannot reach it, so it launches
    # with each method in turn (spawn is the one that re-imports a script's __main__).
    script = tmp_path / "train.py"
    script.write_text(
        "import mgtutor\n"
        "print('TOP LEVEL RAN', flush=True)\n"
        "for method in ('forkserver', 'spawn'):\n"
        "    run = mgtutor.launch(lambda: 7, world_size=2, start_method=method)\n"
        "    print('RESULTS', method, run.results)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=90
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("TOP LEVEL RAN") == 1
    assert "RESULTS forkserver [7, 7]" in done.stdout and "RESULTS spawn [7, 7]" in done.stdout
    assert worker_children() == []


@pytest.mark.any_start_method
def test_progress_board_draws_one_widget_bar_per_rank() -> None:
    from mgtutor.launcher.progress_bars import ProgressBoard

    board = ProgressBoard(2)
    board._widgets_usable = True  # as in JupyterLab; outside a kernel display() prints a repr
    board.update(1, 3, 10, "epoch 0")
    board.update(0, 10, 10, "epoch 0")
    bars = board._bars
    assert [(b.value, b.max) for b in bars] == [(10, 10), (3, 10)]
    assert [b.description for b in bars] == ["rank 0", "rank 1"]
    board.finish(failed_rank=1)
    assert [b.bar_style for b in bars] == ["warning", "danger"]


def test_plain_init_process_group_joins_like_a_torchrun_worker() -> None:
    # What PyTorch's own tutorials write inside a worker, without mgtutor.setup().
    def work() -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    assert mgtutor.launch(work, world_size=2).results == [3.0, 3.0]


def test_every_rank_gets_its_share_of_the_cores_without_calling_setup(monkeypatch) -> None:
    # torchrun gives each of several workers OMP_NUM_THREADS=1; mgtutor gives each rank its
    # share of the cores, also when fn never calls setup() (a plain init_process_group, or none).
    from mgtutor.hardware import usable_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def threads() -> int:
        import torch

        return torch.get_num_threads()

    assert mgtutor.launch(threads, world_size=2).results == [max(1, usable_cores() // 2)] * 2


def test_ranks_see_the_notebooks_current_environment_folder_and_path(tmp_path, monkeypatch) -> None:
    # A forkserver was started earlier, with the environment of that moment; what a cell
    # changes afterwards must reach the ranks exactly as with spawn.
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # the next forkserver launch starts a new server ...
    monkeypatch.setenv("MGTUTOR_TEST_REMOVED", "set when the server started")
    mgtutor.launch(lambda: None, world_size=1)  # ... with this variable in its environment
    monkeypatch.setenv("MGTUTOR_TEST_SETTING", "from the cell")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MGTUTOR_TEST_REMOVED")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))

    def look() -> tuple:
        import sys

        import torch

        return (
            os.environ.get("MGTUTOR_TEST_SETTING"),
            "MGTUTOR_TEST_REMOVED" in os.environ,
            os.getcwd(),
            sys.path[0],
            torch.get_num_threads(),
        )

    expected = ("from the cell", False, str(tmp_path), str(tmp_path / "extra"), 1)
    assert mgtutor.launch(look, world_size=2).results == [expected, expected]


def _how_i_started() -> str | None:
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True)


def test_the_ranks_start_the_way_the_fixture_says(start_method: str) -> None:
    # The start_method fixture sets the launcher's default; a rank reports how it was started.
    assert mgtutor.launch(_how_i_started, world_size=1).results == [start_method]
