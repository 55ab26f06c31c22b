"""Bad input and faults: every one gives a clear error and leaves no process behind."""

from __future__ import annotations

import math
import os
import pickle
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import mgtutor
from mgtutor.launcher import _cleanup
from tests.helpers import open_fds, worker_children

# Every launcher promise holds on both start methods: each test runs once per method.
pytestmark = pytest.mark.usefixtures("start_method")


@pytest.fixture(autouse=True)
def no_process_left():
    yield
    assert worker_children() == [], "a fault left worker processes running"


def test_raising_worker_stops_the_others_quickly() -> None:
    def work() -> None:
        import torch.distributed as dist

        mgtutor.setup(timeout_s=600)
        if dist.get_rank() == 1:
            raise ValueError("bad value in rank 1")
        dist.barrier()  # rank 0 would wait here for ten minutes

    started = time.monotonic()
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(work, world_size=2)
    elapsed = time.monotonic() - started
    error = info.value
    assert error.rank == 1
    assert error.exc_type == "ValueError" and error.exc_message == "bad value in rank 1"
    assert 'raise ValueError("bad value in rank 1")' in error.worker_traceback
    assert isinstance(error.original, ValueError)
    assert "rank 1 raised ValueError: bad value in rank 1" in str(error)
    assert "No process of this launch is left running" in str(error)
    # Far below the barrier's 600 s; generous for spawned ranks importing torch on a busy machine.
    assert elapsed < 120


def test_hang_past_timeout_names_ranks_and_shows_stacks() -> None:
    # torch is a global of fn, so ranks import it before fn starts and the timeout, which counts
    # from there, is not spent on a slow import.
    def work() -> None:
        mgtutor.setup()
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        else:
            time.sleep(3600)

    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(work, world_size=2, timeout=5)
    error = info.value
    assert error.running == [0, 1]
    assert "dist.all_reduce(torch.ones(1))" in error.stacks[0]
    assert "time.sleep(3600)" in error.stacks[1]
    assert "still running: ranks 0, 1." in str(error)


class SlowToUnpickle:
    """Unpickling this in the worker sleeps first, like a slow import on a busy machine."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        return (time.sleep, (self.seconds,))


def test_timeout_does_not_count_start_up_and_start_timeout_limits_it(start_method: str) -> None:
    started = time.monotonic()
    run = mgtutor.launch(lambda arg: "ran", SlowToUnpickle(4), world_size=2, timeout=2)
    assert run.results == ["ran", "ran"]
    took = time.monotonic() - started

    # A spawned rank imports torch before it reads fn (seconds on a busy machine): give it
    # time to get to the unpickling, which start_timeout must also stop. The launch above took
    # its start-up plus 4 s of unpickling: that much again gets a rank past its imports at this
    # machine's present speed.
    limit = 2 if start_method == "forkserver" else max(2, math.ceil(took))
    with pytest.raises(mgtutor.WorkerTimeout, match=f"after start_timeout={limit} s") as info:
        mgtutor.launch(lambda arg: "ran", SlowToUnpickle(60), world_size=2, start_timeout=limit)
    stack = info.value.stacks[0]
    if start_method == "spawn" and "cloudpickle.loads(call.payload)" not in stack:
        # On a loaded machine a spawned rank can still be importing torch after 20 s (seen at a
        # load of 18 on 2 cores): start_timeout stopped the start-up all the same. The forkserver
        # variant, whose ranks have torch already, checks that it stops the unpickling too.
        assert "import" in stack, stack
    else:
        assert "cloudpickle.loads(call.payload)" in stack
    assert "pass a larger start_timeout" in str(info.value)


@pytest.mark.any_start_method  # the limit is counted in the notebook, the same for both
def test_no_timeout_means_no_limit_once_started() -> None:
    # fn runs well past start_timeout: that limit is for the start only, and timeout=None
    # (the default) sets none on fn.
    run = mgtutor.launch(lambda: time.sleep(5) or "done", world_size=2, start_timeout=3)
    assert run.results == ["done", "done"]


def test_rank_killed_by_a_signal_is_named() -> None:
    def work() -> None:
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(work, world_size=2)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    assert info.value.exitcode == -signal.SIGKILL
    assert "killed by signal SIGKILL" in str(info.value) and "out-of-memory" in str(info.value)


def test_exit_code_and_unsendable_result_and_clean_exit() -> None:
    with pytest.raises(mgtutor.WorkerError, match="rank 0 exited with code 3") as info:
        mgtutor.launch(lambda: os._exit(3) if os.environ["RANK"] == "0" else time.sleep(60))
    assert info.value.exitcode == 3
    with pytest.raises(mgtutor.WorkerError, match="result could not be sent back"):
        mgtutor.launch(lambda: threading.Lock(), world_size=1)
    with pytest.raises(mgtutor.WorkerError, match="called sys.exit"):
        mgtutor.launch(lambda: exit(4), world_size=1)
    assert mgtutor.launch(lambda: exit(0), world_size=1).results == [None]


@pytest.fixture
def ctrl_c_raises():
    # A run started in the background (nohup, `&`) inherits SIGINT ignored; these tests need
    # Ctrl+C to raise KeyboardInterrupt, as it does in a notebook.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_after(seconds: float) -> None:
    def fire() -> None:
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def test_interrupt_during_start_up_stops_every_worker(ctrl_c_raises) -> None:
    interrupt_after(1.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        mgtutor.launch(lambda arg: None, SlowToUnpickle(60), world_size=2)
    assert time.monotonic() - started < 15
    assert worker_children() == []
    assert str(info.value).startswith("The cell was interrupted"), str(info.value)


def test_interrupt_stops_every_worker_before_it_reaches_the_caller(ctrl_c_raises, tmp_path) -> None:
    started = []

    def work() -> None:
        (tmp_path / str(os.getpid())).touch()  # fn runs (a spawned rank imported torch first)
        time.sleep(60)

    def interrupt_when_started() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(tmp_path.iterdir())) < 2:
            time.sleep(0.05)
        time.sleep(0.5)
        started.append(len(worker_children()))
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as info:
        mgtutor.launch(work, world_size=2)
    assert started == [2]
    assert worker_children() == []
    assert "Cleanup: stopped rank 0" in info.value.cleanup, str(info.value)
    assert "time.sleep(60)" in info.value.stacks[1], str(info.value)


def test_peer_killed_while_the_others_wait_in_a_collective_is_blamed() -> None:
    def work() -> None:
        import torch
        import torch.distributed as dist

        mgtutor.setup()
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        dist.all_reduce(torch.ones(1))  # rank 0 waits here, then sees a closed connection

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(work, world_size=2, timeout=60)
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL", str(info.value)
    assert str(info.value).startswith("rank 1 was killed by signal SIGKILL")


def test_a_stopped_rank_is_named_as_stopped_not_as_one_more_rank_still_running() -> None:
    # SIGSTOP (or Ctrl-Z's SIGTSTP, or a debugger) pauses a rank: it neither fails nor answers,
    # so its peers wait in the collective until the timeout. The error's first line must say
    # which rank was paused; asking it for its stack would only wait, since it runs nothing.
    def work() -> None:
        import torch
        import torch.distributed as dist

        mgtutor.setup()
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1))  # ranks 0 and 2 wait here for rank 1

    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(work, world_size=3, timeout=5)
    first = str(info.value).splitlines()[0]
    assert "rank 1 was stopped" in first and "ranks 0, 2 waited" in first, first
    assert info.value.running == [0, 1, 2], str(info.value)
    assert "stopped: a paused process runs nothing" in info.value.stacks[1], str(info.value)
    assert "all_reduce" in info.value.stacks[0], str(info.value)


def test_rank_still_exiting_with_cpu_is_given_time(monkeypatch, capfd) -> None:
    # A rank whose process is busy ending after fn returned (here an atexit handler computing
    # for 3 s; on a loaded machine, interpreter shutdown) is not a lingering rank.
    monkeypatch.setattr(_cleanup, "_EXIT_GRACE_S", 1.0)

    def work() -> int:
        import atexit

        def busy() -> None:
            end = time.process_time() + 3
            while time.process_time() < end:
                pass

        atexit.register(busy)
        return int(os.environ["RANK"])

    run = mgtutor.launch(work, world_size=2)
    assert run.results == [0, 1]
    assert run.wall_time_s >= 3  # the launch waited for the exit instead of stopping it
    assert "returned, but its process was still running" not in capfd.readouterr().err


def test_rank_that_returns_but_does_not_exit_is_stopped_and_its_result_kept(
    monkeypatch, capfd
) -> None:
    monkeypatch.setattr(_cleanup, "_EXIT_GRACE_S", 1.0)

    def work() -> int:
        import subprocess

        threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon
        subprocess.Popen(["sleep", "600"])  # a child left running, in the rank's group
        subprocess.Popen(["sleep", "601"], start_new_session=True)  # one that left the group
        return int(os.environ["RANK"]) + 40

    started = time.monotonic()
    assert mgtutor.launch(work, world_size=2).results == [40, 41]
    assert time.monotonic() - started < 30
    err = capfd.readouterr().err
    for rank in (0, 1):
        # Its process group goes with it: the thread and the sleep in its group.
        assert re.search(
            f"rank {rank} returned, but its process was still running [0-9]+ s later", err
        )
        assert "it was stopped and 1 process(es) it had started" in err
    # The rank named the child that left its group before it ended; that one is found too.
    stopped = err.split("left processes running; stopped them (SIGKILL): pids ")[1]
    assert len(stopped.split(".")[0].split(", ")) == 2, err
    assert "still running despite" not in err
    assert not [p for p in worker_children() if "sleep" in " ".join(p.cmdline())]


def test_exceptions_that_cannot_come_back_still_bring_their_text() -> None:
    namespace = {"__name__": "__main__"}
    source = (
        "class BadShape(Exception):\n"
        "    def __init__(self, rank, shape):\n"
        "        super().__init__(f'rank {rank} has shape {shape}')\n"
        "def work():\n"
        "    raise BadShape(1, (2, 3))\n"
        "def locked():\n"
        "    import threading\n"
        "    error = RuntimeError('holds a lock')\n"
        "    error.lock = threading.Lock()\n"
        "    raise error\n"
    )
    import linecache

    filename = "/tmp/ipykernel_0/cell_exc.py"  # as IPython caches a cell: text, no file
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(namespace["work"], world_size=1)
    assert info.value.exc_type == "__main__.BadShape"
    assert info.value.exc_message == "rank 1 has shape (2, 3)"
    assert "raise BadShape(1, (2, 3))" in info.value.worker_traceback
    assert info.value.original is None  # rebuilding it calls __init__ with the wrong arguments
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(namespace["locked"], world_size=1)
    assert info.value.exc_type == "RuntimeError" and info.value.exc_message == "holds a lock"
    assert "raise error" in info.value.worker_traceback


def test_a_stack_dump_signal_never_kills_a_rank() -> None:
    # The dump handler is installed before fn runs (and before the rank says hello, the
    # parent's cue that it may ask for stacks), so SIGUSR1 only writes a stack.
    def work() -> str:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        return "alive"

    assert mgtutor.launch(work, world_size=2).results == ["alive", "alive"]


@pytest.mark.any_start_method
def test_unpicklable_function_or_argument_fails_before_any_process_starts() -> None:
    # The message names the variable that holds what cannot be sent, not only its type.
    lock = threading.Lock()
    with pytest.raises(pickle.PicklingError, match=r"argument 0 `held` \(a _thread.lock\)"):
        mgtutor.launch(lambda held: None, lock)
    with pytest.raises(pickle.PicklingError, match=r"keyword argument `held` \(a _thread.lock"):
        mgtutor.launch(lambda held: None, held=lock)
    with pytest.raises(pickle.PicklingError, match=r"`lock` \(a closure variable of .*lambda"):
        mgtutor.launch(lambda: lock.locked())


@pytest.mark.any_start_method
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "at least 1"),
        ({"world_size": -2}, ValueError, "at least 1"),
        ({"world_size": 2.5}, TypeError, "whole number"),
        ({"world_size": True}, TypeError, "whole number"),
        ({"backend": "mpi"}, ValueError, "backend must be one of"),
        ({"timeout": 0}, ValueError, "positive number of seconds"),
        ({"timeout": "10"}, ValueError, "positive number of seconds"),
        ({"start_timeout": -1}, ValueError, "start_timeout must be a positive"),
        ({"timeout": float("nan")}, ValueError, "positive number of seconds"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        mgtutor.launch(lambda: None, **kwargs)


@pytest.mark.any_start_method
def test_not_a_function_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        mgtutor.launch("train.py")


@pytest.mark.any_start_method
def test_nccl_with_too_few_gpus_says_what_is_available() -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"needs one GPU per rank.*world_size={gpus + 1}"):
        mgtutor.launch(lambda: None, world_size=gpus + 1, backend="nccl")


def test_next_launch_works_after_a_failure() -> None:
    with pytest.raises(mgtutor.WorkerError):
        mgtutor.launch(lambda: 1 / 0, world_size=2)
    assert mgtutor.launch(lambda: "fine", world_size=2).results == ["fine", "fine"]


def test_repeated_launches_leak_no_processes_and_no_descriptors(start_method: str) -> None:
    # Fifty from the forkserver; two spawned (each imports torch, ~4 s): a descriptor or process
    # left per launch shows after one.
    launches = 50 if start_method == "forkserver" else 2
    mgtutor.launch(lambda: None, world_size=2)  # warm-up: the resource tracker starts once
    fds = open_fds()
    pids = set()
    for _ in range(launches):
        run = mgtutor.launch(lambda: os.getpid(), world_size=2)
        pids.update(run.results)
    assert len(pids) == 2 * launches
    assert worker_children() == []
    assert open_fds() == fds


@pytest.mark.any_start_method
def test_launch_while_a_worker_is_bootstrapping_names_the_main_guard(monkeypatch) -> None:
    # What a script without `if __name__ == "__main__":` hits when some other spawn-based
    # pool re-imports it: a clear message instead of multiprocessing's bootstrapping error.
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match='if __name__ == "__main__":'):
        mgtutor.launch(lambda: None)


def test_a_launch_removes_the_doctor_folders_of_ended_notebooks(tmp_path, monkeypatch) -> None:
    # A notebook killed before it closed its pool leaves its folder; the next pool removes it.
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stale = tmp_path / f"mgtutor-fr-{ended.pid}-k2j4"
    live = tmp_path / f"mgtutor-fr-{running.pid}-k2j4"
    unnamed = tmp_path / "mgtutor-fr-k2j4"  # no process id in the name: not known to be stale
    for folder in (stale, live, unnamed):
        folder.mkdir()
        os.mkfifo(folder / "rank0.pkl.ask")
    try:
        seen = []
        real = _cleanup.make_dump_folder
        monkeypatch.setattr(_cleanup, "make_dump_folder", lambda: seen.append(real()) or seen[0])
        assert mgtutor.launch(_returns_rank, world_size=2).results == [0, 1]
        assert not stale.exists() and live.exists() and unnamed.exists()
        assert os.path.basename(seen[0]).startswith(f"mgtutor-fr-{os.getpid()}-")
        assert not os.path.exists(seen[0])  # the launch's own, removed when it closed
    finally:
        running.kill()
        running.wait()


def _returns_rank() -> int:
    return int(os.environ["RANK"])
