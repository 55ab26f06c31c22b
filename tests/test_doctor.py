"""The hang doctor: real gloo ranks desync, and the diagnosis names ranks, collective and cause.

Each rank returns its own record (the ranks catch the collective's timeout themselves), so these
tests need nothing from the launcher beyond ``mgtutor.launch``. Two launches cover everything:
one where a rank skips a collective (asked for its record while its peer is blocked), one with
different shapes, dtypes and operations.
"""

from __future__ import annotations

import os
import pickle
import re
import time

import pytest
import torch

import mgtutor
from mgtutor import doctor

available, why_not = doctor.recorder_available()
pytestmark = pytest.mark.skipif(not available, reason=why_not or "no Flight Recorder")

_HERE = os.path.basename(__file__)


def _skip_a_collective() -> dict:
    """Rank 0 waits in all_reduce #2; rank 1 asks both ranks for records, then returns."""
    import torch.distributed as dist

    path = doctor.start_dump_responder()
    os.environ.update(doctor.recorder_env(100))
    mgtutor.setup(timeout_s=5)
    rank = dist.get_rank()
    pids: list = [None, None]
    dist.all_gather_object(pids, (os.getpid(), path))
    dist.all_reduce(torch.ones(3))  # #3 (all_gather_object made #1 and #2)
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(3))  # #4, blocked until rank 1 leaves: it never calls it
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"error": None}
    latencies, records = [], {}
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # until rank 0 is inside collective #4
        asked = time.perf_counter()
        records = doctor.request_dumps(
            {r: pid for r, (pid, _) in enumerate(pids)}, {r: p for r, (_, p) in enumerate(pids)}
        )
        latencies.append(time.perf_counter() - asked)
        trace = records[0]["trace"]
        # Rank 0 is inside #4 once its status says so and its entry is recorded: torch updates
        # the two one after the other, and a dump can fall between them (seen once under load).
        entered = trace["pg_status"]["0"]["last_enqueued_collective"] == 4
        if entered and any(e["collective_seq_id"] == 4 for e in trace["entries"]):
            break
        time.sleep(0.05)
    doctor.remove_dump_files({r: pid for r, (pid, _) in enumerate(pids)})
    return {"records": records, "latencies": latencies}


def _mismatches() -> dict:
    """#2 broadcast: shapes differ; #3 broadcast: dtypes differ; #4: different operations."""
    import torch.distributed as dist

    mgtutor.setup(timeout_s=1)
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2))
    # A smaller tensor at the root passes silently on gloo (the receiver fills a part); the other
    # way round, or in all_reduce, gloo ends the rank that receives more bytes than it expects.
    dist.broadcast(torch.ones(4 if rank == 0 else 8), src=0)
    dist.broadcast(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64), src=0)
    error = None
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    except RuntimeError as exc:
        error = str(exc)
    return {"record": doctor.own_dump(), "error": error}


def test_recorder_env_and_a_rank_without_responder() -> None:
    assert doctor.recorder_env(200) == {"TORCH_FR_BUFFER_SIZE": "200"}
    with pytest.raises(ValueError, match="buffer_size"):
        doctor.recorder_env(-1)
    # No responder behind this pid: skipped at once, nothing is signalled.
    started = time.monotonic()
    assert doctor.request_dumps({0: os.getpid()}, timeout=5) == {}
    assert time.monotonic() - started < 1


def test_rank_that_skips_a_collective_is_named_while_its_peer_is_blocked() -> None:
    run = mgtutor.launch(_skip_a_collective, world_size=2, timeout=60)
    blocked, asker = run.results
    records = asker["records"]
    assert sorted(records) == [0, 1]
    # Rank 0 answered while its main thread was blocked in all_reduce #4.
    assert records[0]["trace"]["pg_status"]["0"]["last_enqueued_collective"] == 4
    assert max(asker["latencies"]) < 2.0
    diagnosis = doctor.diagnose(records, finished={1})
    assert diagnosis.kind == "finished"
    assert diagnosis.summary.startswith(
        "rank 1 finished fn without calling all_reduce #4, which rank 0 is waiting in ("
    ), diagnosis.summary
    # The frame comes from the responder's stack of rank 0's main thread.
    assert f"{_HERE}:" in diagnosis.summary and "in _skip_a_collective" in diagnosis.summary
    assert "rank 1's last collective was all_reduce #3" in str(diagnosis)
    assert "missing on rank(s) 1" in " ".join(diagnosis.analyzer)
    behind = doctor.diagnose(records)
    assert behind.summary.startswith("rank 1 never reached all_reduce #4"), behind.summary
    # Rank 0's wait ended when rank 1 left (gloo: "Connection closed by peer").
    assert blocked["error"]


def test_shapes_dtypes_and_operations_that_differ_are_named() -> None:
    run = mgtutor.launch(_mismatches, world_size=2, timeout=60)
    assert all(r["error"] for r in run.results), "the different operations should time out"
    records = {r: result["record"] for r, result in enumerate(run.results)}
    diagnosis = doctor.diagnose(records)
    text = str(diagnosis)
    assert diagnosis.kind == "shape" and diagnosis.seq == 2, text
    assert diagnosis.summary.startswith(
        "broadcast #2 got different shapes: rank 0 broadcast [4] Float, rank 1 broadcast [8] Float"
    ), text
    assert re.search(rf"every rank issued it at \S*{_HERE}:\d+, in _mismatches", text), text
    assert (
        "broadcast #3 got different dtypes: rank 0 broadcast [4] Float, rank 1 broadcast [4] "
        "Double" in text
    )
    assert "ranks called different collectives as #4: rank 0 all_reduce, rank 1 broadcast" in text
    assert re.search(rf"rank 1 issued it at \S*{_HERE}:\d+, in _mismatches\)", text), text
    assert "torch's analyzer: broadcast #2: rank 1 SIZE_OR_SYNTAX_MISMATCH" in text
    # The raw records stay on the diagnosis; torch's own dump bytes are accepted as well.
    assert diagnosis.records[0]["trace"]["entries"]
    raw = {r: pickle.dumps(rec["trace"]) for r, rec in records.items()}
    assert doctor.diagnose(raw).summary == diagnosis.summary


def test_missing_records_and_no_recorder_are_said() -> None:
    trace = {
        "entries": [
            {
                "process_group": ("0", "default_pg"),
                "pg_id": 0,
                "collective_seq_id": 1,
                "profiling_name": "gloo:all_reduce",
                "input_sizes": [[4]],
                "input_dtypes": ["Float"],
                "record_id": 0,
            }
        ],
        "pg_status": {"0": {"last_enqueued_collective": 1}},
    }
    alone = doctor.diagnose({1: trace}, world_size=2)
    assert alone.kind == "missing_record" and alone.summary == "no record from rank 0"
    none = doctor.diagnose({0: {"trace": None, "error": "torch 2.4 has no recorder"}})
    assert none.kind == "no_recorder" and "torch 2.4 has no recorder" in none.summary
    agree = doctor.diagnose({0: trace, 1: trace})
    assert agree.kind == "agree"


def _drift() -> tuple[list[str], list[str]]:
    import torch.distributed as dist

    mgtutor.setup()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    before = doctor.find_drift(model)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[1].running_mean += 1
    return before, doctor.find_drift(model)


def test_find_drift_names_the_buffer_changed_on_one_rank() -> None:
    run = mgtutor.launch(_drift, world_size=2, timeout=60)
    assert run.results[0] == run.results[1] == ([], ["1.running_mean"])


def _desync(kind: str) -> None:
    import torch
    import torch.distributed as dist

    mgtutor.setup()
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))
    if kind == "extra" and rank == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 never calls this one
    elif kind == "shapes":
        dist.broadcast(torch.ones(4 if rank == 0 else 8), src=0)
    elif kind == "operations":
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    time.sleep(60)


@pytest.mark.parametrize(
    ("kind", "first_line"),
    [
        ("extra", "rank 1 never reached all_reduce #2, which rank 0 is waiting in ("),
        ("shapes", "broadcast #2 got different shapes: rank 0 broadcast [4] Float, rank 1 "),
        ("operations", "ranks called different collectives as #2: rank 0 all_reduce, rank 1 "),
    ],
)
def test_a_launch_that_times_out_leads_with_the_doctors_finding(kind, first_line) -> None:
    started = time.monotonic()
    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(_desync, kind, world_size=2, timeout=2)
    assert time.monotonic() - started < 15
    text = str(info.value)
    assert text.startswith(first_line), text
    assert "fn ran past its timeout of 2 s" in text  # the launcher's own summary follows
    assert info.value.diagnosis.ranks and set(info.value.diagnosis.records) == {0, 1}
    assert "Where rank 0 was stuck" in text  # the stacks stay
