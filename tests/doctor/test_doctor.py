"""The hang doctor: real gloo ranks desync, and the diagnosis names ranks, collective and cause.

The first tests' ranks return their own records (they catch the collective's timeout
themselves), so they need nothing from the launcher beyond ``mgtutor.launch``: one launch where
a rank skips a collective (asked for its record while its peer is blocked), one with different
shapes, dtypes and operations. The later ones go through the launcher's error, as a learner
sees it: the hangs people actually have (a rank that returned, raised, stayed silent, entered
another group first, or waits in recv), a rank gloo aborts, and records read from torch's own
format (a wrapped ring buffer, a dump between two updates, NCCL's recorder).
"""

from __future__ import annotations

import os
import pickle
import re
import sys
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
        "rank 1 returned from fn without calling all_reduce #4, which rank 0 is waiting in ("
    ), diagnosis.summary
    # The frame comes from the responder's stack of rank 0's main thread.
    assert f"{_HERE}:" in diagnosis.summary and "in _skip_a_collective" in diagnosis.summary
    assert "rank 1's last collective was all_reduce #3" in str(diagnosis)
    assert "missing on rank(s) 1" in " ".join(diagnosis.analyzer)
    in_a_cell = doctor.diagnose(records, finished={1}, work="the %%ddp cell")
    assert in_a_cell.summary.startswith("rank 1 returned from the %%ddp cell without calling")
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
    # What is left is named: the group's backend and the peer's last collective, with shapes.
    assert alone.kind == "missing_record" and alone.summary == (
        "no record from rank 0 (gloo): rank 1's last collective was all_reduce #1 [4] Float"
    )
    placeholder = alone.records[0]
    assert placeholder["trace"] is None and placeholder["from_peers"]
    assert doctor.aborted_on_gloo(placeholder)
    nccl = {**trace, "entries": [{**trace["entries"][0], "profiling_name": "nccl:all_reduce"}]}
    assert not doctor.aborted_on_gloo(doctor.diagnose({1: nccl}, world_size=2).records[0])
    assert not doctor.aborted_on_gloo(None) and not doctor.aborted_on_gloo({"groups": {}})
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


# --- the hangs people actually have, through the launcher's error -----------------------------


def _natural(kind: str) -> None:
    """The desyncs of issue 22, each in its most natural form; rank 0 always waits."""
    import torch.distributed as dist

    mgtutor.setup()
    rank = dist.get_rank()
    if kind == "returned":  # the classic: a collective under `if rank == 0`, rank 1 returns
        if rank == 0:
            dist.all_reduce(torch.ones(2))  # returned: rank 0 waits here
        return
    if kind == "raised":
        dist.all_reduce(torch.ones(2))
        if rank == 1:
            raise ValueError("no batch for rank 1")
        dist.all_reduce(torch.ones(2))  # raised: rank 0 waits here
        return
    if kind == "recv":
        dist.all_reduce(torch.ones(2))
        if rank == 0:
            dist.recv(torch.ones(2), src=1)  # recv: rank 0 waits here
        return
    if kind == "sizes":  # gloo aborts rank 0, which receives more bytes than it expects
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(4 if rank == 0 else 8))
        return
    group = dist.new_group([0, 1])
    if kind == "silent":
        if rank == 0:
            dist.all_reduce(torch.ones(2))  # silent: rank 0 waits here
    elif kind == "subgroup":
        dist.all_reduce(torch.ones(2))
        if rank == 0:
            dist.all_reduce(torch.ones(2), group=group)
    elif kind == "cross":
        first, second = (None, group) if rank == 0 else (group, None)
        dist.all_reduce(torch.ones(2), group=first)
        dist.all_reduce(torch.ones(2), group=second)
    time.sleep(60)


def _line_of(text: str) -> str:
    """``test_doctor.py:LINE, in _natural`` for the line of ``_natural`` that holds ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(_natural)
    number = next(first + i for i, line in enumerate(lines) if text in line)
    return f"{_natural.__code__.co_filename}:{number}, in _natural"


@pytest.mark.parametrize(
    ("kind", "kind_found", "first_line", "more"),
    [
        (
            "returned",
            "finished",
            "rank 1 returned from fn without calling all_reduce #1, which rank 0 is waiting in",
            "rank 1 called no collective",
        ),
        (
            "raised",
            "raised",
            "rank 1 raised ValueError: no batch for rank 1 ({where}) before it reached "
            "all_reduce #2, which rank 0 is waiting in",
            "rank 1's last collective was all_reduce #1",
        ),
        (
            "recv",
            "p2p",
            "rank 0 waits in recv from rank 1",
            "gloo's recorder (torch 2.14) does not record send and recv, so this comes from the "
            "rank's stack; rank 1 returned from fn",
        ),
    ],
)
def test_a_rank_that_returned_or_raised_is_named_with_what_it_did(
    kind, kind_found, first_line, more
) -> None:
    started = time.monotonic()
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(_natural, kind, world_size=2, timeout=30)
    assert time.monotonic() - started < 30  # it fails when rank 1 leaves, not at the timeout
    found = info.value.diagnosis
    text = str(info.value)
    expected = first_line.format(where=_line_of("raise ValueError"))
    assert found.kind == kind_found and found.summary.startswith(expected), text
    assert more in str(found), text
    # Where rank 0 waits: from its traceback, sent with its failure.
    assert found.summary.endswith(f"({_line_of(f'# {kind}: rank 0 waits here')})"), text
    if kind == "raised":  # the exception leads; the doctor says what it did to rank 0
        assert text.startswith("rank 1 raised ValueError: no batch for rank 1\n"), text
    else:
        assert expected in text, text
    assert "never reached" not in text, text


@pytest.mark.parametrize(
    ("kind", "kind_found", "first_line"),
    [
        (
            "silent",
            "behind",
            "rank 1 never reached all_reduce #1, which rank 0 is waiting in ({rank0})",
        ),
        (
            "subgroup",
            "behind",
            "rank 1 never reached all_reduce #1 (process group 1), which rank 0 is waiting in "
            "({rank0})",
        ),
        (
            "cross",
            "order",
            "the ranks wait in collectives of different process groups, each for another: "
            "rank 0 in all_reduce #1 (default group) at {first}; rank 1 in all_reduce #1 "
            "(process group 1) at "
            "{first}",
        ),
    ],
)
def test_a_silent_rank_a_subgroup_and_a_cross_group_order_are_named(
    kind, kind_found, first_line
) -> None:
    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(_natural, kind, world_size=2, timeout=2)
    found = info.value.diagnosis
    waits = {"silent": "# silent: rank 0 waits here", "subgroup": "group=group"}
    rank0 = _line_of(waits[kind]) if kind in waits else ""
    expected = first_line.format(rank0=rank0, first=_line_of("group=first"))
    assert found.kind == kind_found and found.summary == expected, str(info.value)
    if kind == "cross":
        assert found.ranks == [0, 1]
        assert "sequence numbers count per group, so no rank is behind" in str(found)
    else:
        assert f"it is now at {_line_of('time.sleep(60)')}" in str(found)
    assert expected in str(info.value)


def _sizes_without_abort_handler() -> None:
    """The "sizes" desync with SIGABRT back to its default, as on a machine with a GPU."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGABRT, None)  # SIG_DFL: the responder's record-on-abort is gone
    _natural("sizes")


@pytest.mark.skipif(
    not doctor.responder._no_gpu(),
    reason="with a GPU visible the ranks install no abort handler (NCCL's watchdog could stall it)",
)
def test_a_rank_gloo_aborts_leaves_the_record_of_the_collective_that_killed_it() -> None:
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(_natural, "sizes", world_size=2, timeout=30)
    text = str(info.value)
    assert info.value.signal_name == "SIGABRT" and info.value.rank == 0, text
    assert text.startswith(
        "all_reduce #2 got different shapes: rank 0 all_reduce [4] Float, rank 1 all_reduce [8] "
        "Float\n"
    ), text
    assert "On gloo, SIGABRT is gloo giving up" in text and "NCCL's watchdog" not in text, text
    assert info.value.diagnosis.records[0]["aborted"]


def test_a_rank_gloo_aborts_with_no_record_is_named_from_its_peers_record() -> None:
    # Where the dying rank writes nothing (a GPU machine; torch 2.11 there), the other rank's
    # record still names the backend and the collective, and NCCL is not blamed for gloo.
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(_sizes_without_abort_handler, world_size=2, timeout=30)
    text = str(info.value)
    assert info.value.signal_name == "SIGABRT" and info.value.rank == 0, text
    assert info.value.diagnosis.kind == "missing_record", text
    assert info.value.diagnosis.summary.startswith(
        "no record from rank 0 (gloo): rank 1's last collective was all_reduce #2 [8] Float ("
    ), text
    assert "On gloo, SIGABRT is gloo giving up" in text and "NCCL's watchdog" not in text, text
    assert info.value.diagnosis.records[0]["from_peers"]


# --- records in torch's own format ------------------------------------------------------------


def _entry(seq: int, op: str = "gloo:all_reduce", record_id: int | None = None, **more) -> dict:
    """One recorder entry with the keys torch 2.14 writes (FlightRecorder.hpp, version 2.10)."""
    return {
        "record_id": seq - 1 if record_id is None else record_id,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": op,
        "time_created_ns": seq,
        "input_sizes": [[4]],
        "input_dtypes": ["Float"],
        "output_sizes": [[4]],
        "output_dtypes": ["Float"],
        "state": "completed",
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": True,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [],
        **more,
    }


def _trace(entries: list, enqueued: int, started: int = -1, completed: int | None = None) -> dict:
    done = enqueued if completed is None else completed
    status = {
        "last_enqueued_collective": enqueued,
        "last_started_collective": started,
        "last_completed_collective": done,
    }
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": status},
        "entries": entries,
    }


def test_uneven_all_to_all_and_a_scatter_from_its_root_are_not_called_different_shapes() -> None:
    # all_to_all_single with uneven splits: each rank sends its own number of rows. A scatter:
    # only the root passes the list, the other ranks record no input. Neither is a desync.
    def two(op: str, sizes: list, dtypes: list) -> dict:
        return {"input_sizes": sizes, "input_dtypes": dtypes, "profiling_name": op}

    cases = {
        "gloo:all_to_all": (two("", [[6, 4]], ["Float"]), two("", [[2, 4]], ["Float"])),
        "gloo:scatter": (two("", [[2, 16, 32]], ["Float"]), two("", [], [])),
        "gloo:all_reduce": (two("", [[4]], ["Float"]), two("", [[8]], ["Float"])),
    }
    kinds = {}
    for op, (mine, theirs) in cases.items():
        first = [_entry(1, op, **{**mine, "profiling_name": op}), _entry(2)]
        second = [_entry(1, op, **{**theirs, "profiling_name": op}), _entry(2)]
        kinds[op] = doctor.diagnose({0: _trace(first, 2), 1: _trace(second, 2)}).kind
    # The counterfactual is the all_reduce: there, different sizes are the bug.
    assert kinds == {
        "gloo:all_to_all": "agree",
        "gloo:scatter": "agree",
        "gloo:all_reduce": "shape",
    }
    # Different dtypes in an all_to_all are still a mistake.
    dtype = [_entry(1, "gloo:all_to_all", input_dtypes=["Double"])]
    assert (
        doctor.diagnose({0: _trace([_entry(1, "gloo:all_to_all")], 1), 1: _trace(dtype, 1)}).kind
        == "dtype"
    )


def test_a_wrapped_ring_buffer_is_partial_and_a_dump_between_two_updates_is_no_agreement() -> None:
    # Both ranks ran 300 collectives with a buffer of 100: the records hold #201 to #300.
    kept = [_entry(seq) for seq in range(201, 301)]
    agree = doctor.diagnose({0: _trace(kept, 300), 1: _trace(kept, 300)})
    assert agree.kind == "agree" and "partial" in agree.summary, str(agree)
    assert "partial records: a recorder keeps only the latest collectives" in str(agree)
    assert "here rank 0 the latest 100, rank 1 the latest 100)" in str(agree)
    # Rank 1 stopped after #3; rank 0 went on to #300, its entries before #201 dropped.
    early = [_entry(seq) for seq in range(1, 4)]
    behind = doctor.diagnose({0: _trace(kept, 300), 1: _trace(early, 3)})
    assert behind.summary == "rank 1 never reached collective #4, which rank 0 is waiting in"
    assert "rank 0's record counts #4 but dropped it (a partial record)" in str(behind)
    # Rank 0's status already counts #2 but its entry is not written yet; rank 1 is at #1.
    ahead = doctor.diagnose({0: _trace([_entry(1)], 2, completed=1), 1: _trace([_entry(1)], 1)})
    assert ahead.kind == "behind", str(ahead)
    assert ahead.summary == "rank 1 never reached collective #2, which rank 0 is waiting in"
    assert "rank 0's record counts #2 but does not hold it yet" in str(ahead)


def _nccl_records() -> dict:
    """Rank 0 queued all_reduce #2 and #3 (NCCL returns at once); #2 runs on its GPU, waiting
    for rank 1, whose last collective is #1."""
    rank0 = [
        _entry(1, "nccl:all_reduce"),
        _entry(2, "nccl:all_reduce", state="started", retired=False),
        _entry(3, "nccl:all_reduce", state="scheduled", retired=False),
    ]
    return {
        0: _trace(rank0, 3, started=2, completed=1),
        1: _trace([_entry(1, "nccl:all_reduce")], 1),
    }


def test_nccl_records_come_from_nccls_recorder_and_their_counters_are_read(monkeypatch) -> None:
    c10d = torch._C._distributed_c10d
    records = _nccl_records()
    gloo = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda **_: pickle.dumps(gloo), raising=False)
    monkeypatch.setattr(
        c10d, "_dump_nccl_trace", lambda **_: pickle.dumps(records[0]), raising=False
    )
    # A rank whose default group is NCCL (this CPU test has no process group).
    groups = {"0": {"ranks": [0, 1], "backend": "nccl"}}
    monkeypatch.setattr(
        sys.modules[doctor.own_dump.__module__], "_groups", lambda: groups, raising=False
    )
    own = doctor.own_dump(stack_traces=False)
    assert [e["collective_seq_id"] for e in own["trace"]["entries"]] == [1, 2, 3], own
    found = doctor.diagnose({0: own, 1: records[1]})
    assert found.summary == "rank 1 never reached all_reduce #2, which rank 0 is waiting in"
    assert (
        "on rank 0, all_reduce #2 is started on the GPU and has not completed; 1 later "
        "collective(s) are queued behind it" in str(found)
    ), str(found)


def test_a_ddp_cells_diagnosis_names_the_cell_not_fn(monkeypatch) -> None:
    from types import SimpleNamespace

    from mgtutor.launcher import _report, magic

    seen = {}
    monkeypatch.setattr(doctor, "diagnose", lambda records, **kwargs: seen.update(kwargs))
    record = {"trace": {"entries": [{"collective_seq_id": 1}]}, "call": None}
    handles = [
        SimpleNamespace(
            rank=r,
            process=SimpleNamespace(pid=None),  # ended: its record came with its answer
            error=None,
            done=SimpleNamespace(record={"flight_record": record}),
        )
        for r in (0, 1)
    ]
    _report.diagnose(handles, {}, magic._DDP_WORDING)
    assert seen["work"] == "the %%ddp cell"
    _report.diagnose(handles, {})
    assert seen["work"] == "fn"
