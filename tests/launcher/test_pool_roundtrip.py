"""A pool call's reply path: the notebook wakes for the ranks' answers, never for a timer.

No timing is asserted here (speed is measured in benchmarks/pool_roundtrip.py). What is
counted instead: each wait of the notebook must end because something arrived (its poll
interval is raised to ten minutes, so a wait that ended on its timeout would show as a hang),
nothing sleeps, and a silent call costs each rank exactly one message and no output. A
regression that waited on a timer, polled, or sent more messages per call fails these counts.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time

import pytest

import mgtutor
from mgtutor.launcher import _relay, _supervise, _watch


def _silent() -> None:
    return None


def _prints() -> int:
    print("one line", flush=False)
    print("a last line without a newline", end="")
    return 7


@pytest.fixture
def counted(monkeypatch):
    counts = {"empty waits": 0, "waits": 0, "answers": 0, "reads": 0, "sleeps": 0}
    real_wait = _supervise.Supervisor._wait
    real_receive = _supervise.Supervisor._receive
    real_read = _relay.RankOutput.read

    def wait(self, watched, timeout):
        ready = real_wait(self, watched, timeout)
        counts["waits"] += 1
        counts["empty waits"] += not ready
        return ready

    def receive(self, h):
        counts["answers"] += 1
        return real_receive(self, h)

    def read(self, name):
        counts["reads"] += 1
        return real_read(self, name)

    def sleep(seconds):
        counts["sleeps"] += 1

    monkeypatch.setattr(_supervise, "POLL_S", 600.0)
    monkeypatch.setattr(_supervise.Supervisor, "_wait", wait)
    monkeypatch.setattr(_supervise.Supervisor, "_receive", receive)
    monkeypatch.setattr(_relay.RankOutput, "read", read)
    monkeypatch.setattr(_supervise, "time", _NoSleep(time, sleep))
    monkeypatch.setattr(_watch, "time", _NoSleep(time, sleep))  # the loop that waits
    return counts


class _NoSleep:
    """The time module as _supervise and _watch see it, with sleep counted instead of slept."""

    def __init__(self, real, sleep):
        self._real, self.sleep = real, sleep

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.timeout(300)
def test_a_silent_call_wakes_the_notebook_once_per_rank_answer(counted) -> None:
    with mgtutor.Pool(world_size=2, backend="gloo") as pool:
        pool.run(_silent)  # the first call may send the notebook's cells and environment
        for key in counted:
            counted[key] = 0
        calls = 20
        for _ in range(calls):
            run = pool.run(_silent)
            assert run.results == [None, None]
            assert all(r.memory.peak_rss > 0 and r.wall_time_s >= 0 for r in run.ranks)
        counted = dict(counted)  # the calls' counts, not the closing's
    assert counted["sleeps"] == 0
    assert counted["empty waits"] == 0
    assert counted["answers"] == 2 * calls  # Done only: no start message, no other
    assert counted["reads"] == 0  # no output, and no end-of-call marker in it
    assert counted["waits"] <= 2 * calls  # at most one wake per answer


@pytest.mark.timeout(300)
def test_output_is_relayed_whole_when_the_answer_comes(counted, capsys) -> None:
    with mgtutor.Pool(world_size=2, backend="gloo") as pool:
        for _ in range(3):
            run = pool.run(_prints)
            assert run.results == [7, 7]
            out = capsys.readouterr().out
            for rank in (0, 1):
                assert f"[rank {rank}] one line\n" in out
                assert f"[rank {rank}] a last line without a newline\n" in out
        counted = dict(counted)
    assert counted["sleeps"] == 0
    assert counted["empty waits"] == 0


def test_the_forkservers_fallback_without_proc_finds_children() -> None:
    # Where /proc is missing (macOS), the server's SIGTERM handler lists its ranks with psutil.
    import subprocess
    import sys

    from mgtutor.launcher import _processes

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in _processes._children_from_psutil(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert child.pid not in _processes._children_from_psutil(os.getpid())


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(select, "POLLRDHUP"), reason="POLLRDHUP is Linux's")
def test_a_rank_in_a_call_ends_when_the_notebooks_end_of_its_pipe_hangs_up() -> None:
    # The rank's main thread reads its pipe only between calls; while fn runs, a thread that
    # waits for the hang-up alone must end the rank (the notebook died, its pipe closed).
    def slow() -> None:
        time.sleep(60)

    errors: list[BaseException] = []
    with mgtutor.Pool(world_size=2, backend="gloo") as pool:
        h = pool._supervisor.handles[0]

        def call() -> None:
            try:
                pool.run(slow)
            except BaseException as exc:
                errors.append(exc)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        while not (h.call == 1 and h.check_started()):  # fn runs in rank 0
            time.sleep(0.05)
        end = socket.socket(fileno=os.dup(h.conn.fileno()))
        end.shutdown(socket.SHUT_RDWR)  # what the notebook's death does to the pipe
        end.close()
        caller.join(30)  # fn would sleep 60 s more
        assert not caller.is_alive()
        assert h.exitcode == -signal.SIGKILL
    assert errors and isinstance(errors[0], mgtutor.WorkerError)
    assert "rank 0 was killed by signal SIGKILL" in str(errors[0])
