"""How long the launcher's processes live: the idle timeout, shutdown(), and the notebook's death.

Each process is looked at from outside (psutil): a pid that no longer runs, not a flag the
launcher keeps about itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver

import psutil
import pytest

import mgtutor
from mgtutor.launcher import lifetime

IDLE_S = 1.0


def _server() -> int | None:
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _running(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids of ``pids`` still running ``seconds`` from now (polled; empty once all ended)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until and any(_running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


def test_idle_ranks_and_server_stop_and_the_next_call_starts_them_saying_so(
    monkeypatch, capsys
) -> None:
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, str(IDLE_S))
    with mgtutor.Pool(world_size=2, idle_timeout=IDLE_S) as pool:
        pool.run(keep_a_name)
        assert pool.run(holds_the_name).results == [True, True]
        ranks, server = pool.run(os.getpid).results, _server()
        assert all(_running(p) for p in [*ranks, server])
        capsys.readouterr()
        left = _gone_within([*ranks, server], 20 * IDLE_S)
        assert not left, f"still running after {IDLE_S} s idle: {left} (ranks {ranks})"
        assert not pool.alive and not pool.closed

        again = pool.run(os.getpid).results
        out = capsys.readouterr().out
        assert "the rank server had stopped after 1 s idle; starting it again" in out.replace(
            f" ({lifetime.IDLE_TIMEOUT_ENV})", ""
        ), out
        assert "the pool's ranks had stopped after 1 s with no call" in out, out
        assert len(set(again)) == 2 and not set(again) & set(ranks)
        assert _running(_server()) and _server() != server
        # The new ranks are new: what the old ones held is gone.
        assert pool.run(holds_the_name).results == [False, False]


def keep_a_name() -> None:
    global held
    held = 1


def holds_the_name() -> bool:
    return "held" in globals()


def test_a_call_longer_than_the_idle_timeout_is_never_cut(monkeypatch, capsys) -> None:
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, str(IDLE_S))
    with mgtutor.Pool(world_size=2, idle_timeout=IDLE_S) as pool:
        ranks = pool.run(os.getpid).results
        assert pool.run(lambda: time.sleep(4 * IDLE_S) or os.getpid()).results == ranks
        assert pool.run(os.getpid).results == ranks  # the clock starts at a call's end
        assert "had stopped" not in capsys.readouterr().out


@pytest.mark.parametrize("off", ["argument", "environment"])
def test_the_idle_timeout_turned_off_keeps_everything(monkeypatch, capsys, off) -> None:
    # The counterfactual of the first test, kept as a test: with the timeout off (None, or
    # MGTUTOR_IDLE_TIMEOUT=off) the same wait stops nothing.
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, "off" if off == "environment" else str(IDLE_S))
    timeout = None if off == "argument" else lifetime.FROM_ENVIRONMENT
    with mgtutor.Pool(world_size=2, idle_timeout=timeout) as pool:
        ranks, server = pool.run(os.getpid).results, _server()
        time.sleep(4 * IDLE_S)
        assert all(_running(p) for p in [*ranks, server])
        assert pool.run(os.getpid).results == ranks and _server() == server
        assert "had stopped" not in capsys.readouterr().out


def test_an_idle_server_alone_stops_after_a_launch(monkeypatch, capsys) -> None:
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, str(IDLE_S))
    assert mgtutor.launch(dist_rank, world_size=2).results == [0, 1]
    server = _server()
    assert _running(server) and not _gone_within([server], 20 * IDLE_S)
    capsys.readouterr()
    assert mgtutor.launch(dist_rank, world_size=2).results == [0, 1]
    assert "the rank server had stopped after 1 s idle" in capsys.readouterr().out


def dist_rank() -> int:
    return int(os.environ["RANK"])


def test_shutdown_closes_every_pool_and_stops_the_server(monkeypatch, capsys) -> None:
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, "off")
    pools = [mgtutor.Pool(world_size=2), mgtutor.Pool(world_size=1)]
    pids = [p for pool in pools for p in pool.run(os.getpid).results] + [_server()]
    capsys.readouterr()
    mgtutor.shutdown()
    assert "closed 2 pools (3 ranks) and stopped the rank server" in capsys.readouterr().out
    assert all(pool.closed for pool in pools)
    assert not _gone_within(pids, 10)
    assert mgtutor.launch(dist_rank, world_size=2).results == [0, 1]  # starts what it needs
    mgtutor.shutdown()
    mgtutor.shutdown()
    assert capsys.readouterr().out.endswith("nothing was running (no pool, no rank server).\n")


@pytest.mark.parametrize("bad", [0, -1, "10", True])
def test_a_bad_idle_timeout_is_refused_before_anything_starts(bad) -> None:
    with pytest.raises(mgtutor.ArgumentError, match="idle_timeout must be a positive number"):
        mgtutor.Pool(world_size=1, idle_timeout=bad)


def test_a_bad_environment_value_is_refused_with_what_to_set(monkeypatch) -> None:
    monkeypatch.setenv(lifetime.IDLE_TIMEOUT_ENV, "ten minutes")
    with pytest.raises(mgtutor.ArgumentError, match="MGTUTOR_IDLE_TIMEOUT='ten minutes'"):
        mgtutor.Pool(world_size=1)
    assert lifetime.describe(600) == "10 min" and lifetime.describe(90) == "1.5 min"


_KERNEL = """
import os, sys, time
import mgtutor
from mgtutor.rank.loop import die_with_parent

if __name__ == "__main__":
    pool = mgtutor.Pool(world_size=2, start_method=sys.argv[1])
    print(*pool.run(os.getpid).results, int(die_with_parent(os.getppid())), flush=True)
    time.sleep(120)
"""

# Where PR_SET_PDEATHSIG does not exist (macOS), nothing asks the kernel to signal the server or
# a rank: they must notice the notebook's end from the pipes it held. This takes prctl away, in
# every process started with it on the path, before any of mgtutor is imported.
_NO_PRCTL = """
import ctypes


class _NoPrctl(ctypes.CDLL):
    def __getattr__(self, name):
        if name == "prctl":
            return lambda *args: -1
        return super().__getattr__(name)


ctypes.CDLL = _NoPrctl
"""


@pytest.mark.parametrize(
    ("method", "pdeathsig"),
    [("forkserver", True), ("forkserver", False), ("spawn", False)],
)
def test_nothing_of_mgtutor_outlives_a_killed_notebook(tmp_path, method, pdeathsig) -> None:
    if pdeathsig and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's; the other cases are what runs elsewhere")
    script = tmp_path / "kernel.py"
    script.write_text(_KERNEL)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    if not pdeathsig:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(_NO_PRCTL)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    kernel = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, text=True, env=env
    )
    everything: list[int] = []
    try:
        *ranks, prctl = (int(p) for p in kernel.stdout.readline().split())
        assert len(ranks) == 2 and prctl == pdeathsig, (ranks, prctl)
        # Everything the notebook started: the ranks, the server, multiprocessing's tracker.
        everything = [p.pid for p in psutil.Process(kernel.pid).children(recursive=True)]
        assert set(ranks) <= set(everything) and len(everything) >= 3, everything
    finally:
        kernel.send_signal(signal.SIGKILL)  # as a dying kernel: no cleanup code runs
        kernel.wait(10)
    try:
        left = _gone_within(everything, 10)
        described = [" ".join(psutil.Process(p).cmdline())[-60:] for p in left]
        assert not left, f"still running 10 s after the notebook died: {described}"
    finally:
        for pid in everything:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
