"""What a learner sees after Stop on a hung call, after a peer's consequent error, and after a
result that cannot travel back (issue 34).

Stop (Kernel > Interrupt) reaches the kernel's main thread as SIGINT, which Python turns into
KeyboardInterrupt wherever the notebook waits: these tests send SIGINT to their own process once
the ranks hang, and read what IPython then shows.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import mgtutor
import mgtutor.launcher.magic
from mgtutor.doctor import Diagnosis, recorder_available
from mgtutor.errors import WorkerInterrupted
from mgtutor.launcher import _cleanup, _report
from mgtutor.wire.messages import Failed
from tests.helpers import worker_children

# The diagnosis reads the ranks' Flight Recorder records of gloo's collectives, which a newer
# torch keeps and the package's floor, 2.4, does not (it records NCCL only): without them no
# line names the stuck rank, and the tests that expect one skip, as tests/doctor does.
_RECORDER, _WHY_NOT = recorder_available()
needs_recorder = pytest.mark.skipif(not _RECORDER, reason=_WHY_NOT or "no Flight Recorder")

FULL_TRACEBACK_ENV = "MGTUTOR_FULL_TRACEBACK"
_PACKAGE = os.path.dirname(os.path.abspath(mgtutor.__file__))
_DIAGNOSIS = re.compile(r"^WorkerInterrupted: rank 1 never reached all_reduce #\d+, which rank 0 ")

# Rank 0 waits in a collective rank 1 never calls; rank 1 says so (the marker) and sleeps.
_HANG = """\
def work(marker):
    import pathlib, time
    import torch, torch.distributed as dist
    if not dist.is_initialized():
        mgtutor.setup()
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        pathlib.Path(marker).touch()
        time.sleep(3600)
"""


@pytest.fixture
def ctrl_c_raises():
    # A run started in the background inherits SIGINT ignored; a kernel's raises.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def shell(monkeypatch, ctrl_c_raises):
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.delenv(FULL_TRACEBACK_ENV, raising=False)
    shell = get_ipython()
    shell.InteractiveTB.skip_hidden = True
    shell.run_cell("import mgtutor")
    yield shell
    mgtutor.launcher.magic.ddp_stop("")
    shell.run_cell("_p = globals().pop('pool', None)\nif _p is not None: _p.close()")
    assert worker_children() == [], "the interrupt left processes running"


def _stop_when(marker: Path, *, again_after: float | None = None) -> list[float]:
    """Press Stop once ``marker`` exists (the ranks hang by then); again after a while if asked.

    Returns:
        The times (``time.monotonic()``) Stop was pressed, filled in as it is.
    """
    pressed: list[float] = []

    def press() -> None:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0 enters its collective
        pressed.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
        if again_after is not None:
            time.sleep(again_after)
            pressed.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press, daemon=True).start()
    return pressed


def _shown(shell, capsys, cell: str) -> tuple[list[str], str]:
    """The lines IPython shows for the cell's error (blank and mgtutor's notes dropped)."""
    capsys.readouterr()
    result = shell.run_cell(cell)
    assert isinstance(result.error_in_exec, WorkerInterrupted), result.error_in_exec
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.strip() and not line.startswith("mgtutor: ")]
    return lines, "\n".join(lines)


def _no_mgtutor_frame(text: str) -> None:
    assert _PACKAGE not in text, text  # no frame of mgtutor's files, on either side
    assert "During handling" not in text and "Traceback (most recent call last)" not in text


@needs_recorder
def test_stop_on_a_hung_launch_names_the_stuck_rank_and_leaves_nothing(
    shell, capsys, tmp_path
) -> None:
    marker = tmp_path / "hung"
    _stop_when(marker)
    lines, text = _shown(shell, capsys, f"{_HANG}mgtutor.launch(work, {str(marker)!r})")
    assert _DIAGNOSIS.match(lines[0]), text
    assert "The cell was interrupted" in text and "before ranks 0, 1 finished fn" in text, text
    assert "Where rank 0 was" in text and "dist.all_reduce(torch.ones(1))" in text, text
    assert "Called from:" in text and "mgtutor.launch(work" in text, text
    _no_mgtutor_frame(text)
    assert worker_children() == []  # psutil's list of this process's children


@needs_recorder
def test_stop_on_a_hung_pool_run_names_the_stuck_rank_and_stops_its_ranks(
    shell, capsys, tmp_path
) -> None:
    marker = tmp_path / "hung"
    assert shell.run_cell(f"{_HANG}pool = mgtutor.Pool(2)").success
    _stop_when(marker)
    lines, text = _shown(shell, capsys, f"pool.run(work, {str(marker)!r})")
    assert _DIAGNOSIS.match(lines[0]), text
    # Rank 1 stopped fn (its KeyboardInterrupt shows where); rank 0 could not, in gloo's wait.
    assert "rank 0 did not stop within 3 s" in text, text
    assert "time.sleep(3600)" in text, text
    _no_mgtutor_frame(text)
    assert not shell.user_ns["pool"].alive
    assert worker_children() == []


def test_stop_with_a_paused_rank_says_it_was_stopped(shell, capsys, tmp_path) -> None:
    # A rank paused by SIGSTOP (Ctrl-Z, a debugger) cannot take the interrupt or write its
    # stack: the error says it was stopped rather than leaving the learner to guess.
    marker = tmp_path / "paused"
    cell = _HANG.replace("time.sleep(3600)", "os.kill(os.getpid(), signal.SIGSTOP)")
    cell = cell.replace("import pathlib, time", "import os, pathlib, signal, time")
    assert shell.run_cell(f"{cell}pool = mgtutor.Pool(2)").success
    _stop_when(marker)
    _, text = _shown(shell, capsys, f"pool.run(work, {str(marker)!r})")
    assert "did not stop within 3 s" in text, text
    assert "Rank 1 was stopped (paused by SIGSTOP" in text, text
    assert not shell.user_ns["pool"].alive
    assert worker_children() == []


@needs_recorder
def test_stop_on_a_hung_ddp_cell_names_the_stuck_rank(shell, capsys, tmp_path) -> None:
    marker = tmp_path / "hung"
    shell.run_line_magic("load_ext", "mgtutor")
    shell.user_ns["MARK"] = str(marker)
    _stop_when(marker)
    cell = (
        "%%ddp\n"
        "import pathlib, time, torch, torch.distributed as dist\n"
        "dist.all_reduce(torch.ones(1))\n"
        "if dist.get_rank() == 0:\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "else:\n"
        "    pathlib.Path(MARK).touch()\n"
        "    time.sleep(3600)\n"
    )
    lines, text = _shown(shell, capsys, cell)
    assert _DIAGNOSIS.match(lines[0]), text
    assert lines[0].endswith("which rank 0 is waiting in (cell line 4)"), text  # the %%ddp cell's
    assert "finished the %%ddp cell" in text, text
    _no_mgtutor_frame(text)
    mgtutor.launcher.magic.ddp_stop("")
    assert worker_children() == []


def test_a_second_stop_skips_the_asking_and_still_stops_every_rank(
    ctrl_c_raises, tmp_path, monkeypatch
) -> None:
    def slow_diagnose(*args, **kwargs):
        time.sleep(60)  # a doctor that does not answer

    monkeypatch.setattr(_report, "diagnose", slow_diagnose)
    namespace = {"mgtutor": mgtutor}
    exec(_HANG, namespace)
    marker = tmp_path / "hung"
    pressed = _stop_when(marker, again_after=1.0)
    with pytest.raises(KeyboardInterrupt) as info:
        mgtutor.launch(namespace["work"], str(marker))
    assert len(pressed) == 2 and time.monotonic() - pressed[1] < 10, pressed  # not 60 s
    assert isinstance(info.value, WorkerInterrupted), info.value
    assert info.value.diagnosis is None  # the asking was cut short
    assert "No process of this launch is left running" in str(info.value)
    assert worker_children() == []


def test_rank_lists_read_as_ranks_not_as_counts() -> None:
    assert _report.ranks_named([0]) == "rank 0"
    assert _report.ranks_named([0, 2]) == "ranks 0, 2"
    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(lambda: time.sleep(60), world_size=1, timeout=1)
    assert "still running: rank 0." in str(info.value), str(info.value)


@needs_recorder
def test_a_peers_error_after_the_cause_is_labelled_a_consequence() -> None:
    def work() -> None:
        import torch
        import torch.distributed as dist

        mgtutor.setup()
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 returns, and its process ends

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(work, world_size=2, timeout=60)
    error = info.value
    assert error.rank == 0 and error.diagnosis.kind == "finished", str(error)
    assert error.summary.startswith("rank 0 (a consequence: its peer, rank 1, returned) raised "), (
        str(error)
    )
    assert "\n" not in error.summary and "GLHF" not in error.summary, error.summary


def test_a_consequence_is_said_only_when_the_doctor_blames_another_rank() -> None:
    gloo = (
        "[pair.cc:561] Connection closed by peer [127.0.0.1]:1234. This is typically caused by "
        "a remote worker crashing. GLHF!"
    )
    failed = Failed(1, "RuntimeError", gloo, "", None, "raised", 0.0)
    h = SimpleNamespace(rank=0, error=failed, exitcode=None)
    blames_1 = Diagnosis("rank 1 returned ...", kind="finished", ranks=[1])
    said = _report.describe(h, "", blames_1).summary
    assert said == (
        "rank 0 (a consequence: its peer, rank 1, returned) raised RuntimeError: "
        "[pair.cc:561] Connection closed by peer [127.0.0.1]:1234."
    ), said
    for other in (None, Diagnosis("rank 0 ...", kind="behind", ranks=[0])):
        assert _report.describe(h, "", other).summary == f"rank 0 raised RuntimeError: {gloo}"


def test_a_result_that_cannot_be_sent_back_names_its_type_place_and_return_line() -> None:
    def generator_inside() -> dict:
        it = (i for i in range(3))
        return {"it": it, "n": 3}

    def a_lock() -> object:
        return threading.Lock()

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(generator_inside, world_size=1)
    text = str(info.value)
    assert "result['it'] is a generator, which cannot be pickled" in text, text
    assert "return plain data (tensors on the CPU, numbers" in text, text
    assert 'return {"it": it, "n": 3}' in info.value.worker_traceback, text
    assert f"{__file__}:" in info.value.worker_traceback, text
    assert "cloudpickle" not in text, text

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(a_lock, world_size=1)
    text = str(info.value)
    assert "fn returned a _thread.lock, which cannot be pickled" in text, text
    assert "return threading.Lock()" in info.value.worker_traceback, text
    assert "cloudpickle" not in text, text
    assert worker_children() == []


def test_the_cleanup_says_a_rank_that_failed_after_the_cause_failed_as_a_consequence() -> None:
    gloo = "[pair.cc:561] Connection closed by peer [127.0.0.1]:1234. This is ... GLHF!"
    cause = SimpleNamespace(rank=1, failed_at=1.0)
    later = SimpleNamespace(
        rank=0, failed_at=2.0, error=Failed(1, "RuntimeError", gloo, "", None, "raised", 2.0)
    )
    assert _cleanup.failed_note(later, cause) == (
        "rank 0 then failed, a consequence of rank 1's failure (RuntimeError: [pair.cc:561] "
        "Connection closed by peer [127.0.0.1]:1234.)"
    )
    earlier = SimpleNamespace(rank=1, failed_at=3.0)
    assert _cleanup.failed_note(later, earlier).startswith("rank 0 had already failed (")


def test_the_cleanup_does_not_call_the_same_error_on_another_rank_a_consequence() -> None:
    # Both ranks ran into the same bug (fn never joined a process group): not a consequence.
    bug = "Default process group has not been initialized, please make sure to call it."
    cause = SimpleNamespace(
        rank=0, failed_at=1.0, error=Failed(0, "ValueError", bug, "", None, "raised", 1.0)
    )
    later = SimpleNamespace(
        rank=1, failed_at=2.0, error=Failed(1, "ValueError", bug, "", None, "raised", 2.0)
    )
    assert _cleanup.failed_note(later, cause) == (
        "rank 1 then failed the same way (ValueError: Default process group has not been "
        "initialized, please make sure to call it.)"
    )
