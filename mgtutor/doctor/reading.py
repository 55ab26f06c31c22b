"""Reading the ranks' records: each process group's collectives per rank, and where ranks were.

A record is what :func:`~mgtutor.doctor.own_dump` returns. Here it becomes, per process group,
one :class:`GroupView` per member rank: its collectives by sequence number and the counters
torch keeps (last enqueued, started, completed). A member with no entry for a group is kept,
with nothing enqueued: a rank that never called the group's collective is exactly what a hang
is about. Sequence numbers count per group; they say nothing across groups. What the records
themselves show (dropped entries, a rank aborted, a collective still on the GPU) becomes notes.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")
_DDP_CELL_FILE = re.compile(r"^<ddp-cell-\d+>$")  # a %%ddp cell's code (launcher.magic)
_C10D_FILE = os.path.join("distributed", "distributed_c10d.py")


def _torch_dir() -> str:
    spec = sys.modules.get("torch")
    if spec is not None and spec.__file__:
        return os.path.dirname(os.path.abspath(spec.__file__))
    import importlib.util

    found = importlib.util.find_spec("torch")
    origin = found.origin if found is not None else None
    return os.path.dirname(os.path.abspath(origin)) if origin else "\0"


_TORCH_DIR = _torch_dir()


def as_record(rank: int, dump: object) -> dict[str, Any]:
    """A rank's record from what the caller has: an own_dump dict, its bytes, or torch's dump."""
    if isinstance(dump, (bytes, bytearray)):
        dump = pickle.loads(dump)
    if not isinstance(dump, dict):
        raise TypeError(f"rank {rank}'s dump must be bytes or a dict, got {type(dump).__name__}")
    if "entries" in dump or "pg_status" in dump:  # torch's own dump, as _dump_fr_trace gives it
        return {"rank": rank, "trace": dump, "stack": [], "error": None}
    return {**dump, "rank": rank}


def user_frame(frames: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame outside torch, the standard library and mgtutor: the caller's."""
    for frame in frames:
        filename = frame.get("filename", "")
        if filename.startswith((_TORCH_DIR, _STDLIB_DIR, _PACKAGE_DIR)) or (
            filename.startswith("<") and not _DDP_CELL_FILE.match(filename)
        ):
            continue
        return frame
    return None


def where(frame: dict[str, Any] | None) -> str:
    """``cell line 6, in fn`` for a notebook cell, ``path:line, in fn`` for a file."""
    if frame is None:
        return ""
    filename, line, name = frame.get("filename", "?"), frame.get("line", "?"), frame.get("name")
    if _DDP_CELL_FILE.match(filename):
        return f"cell line {line}" + (f", in {name}" if name != "<module>" else "")
    place = f"cell line {line}" if _CELL_FILE.search(filename) else f"{filename}:{line}"
    return f"{place}, in {name}"


def op_name(entry: dict[str, Any]) -> str:
    """``all_reduce`` from the recorder's ``gloo:all_reduce`` (or ``nccl:all_reduce``)."""
    return str(entry.get("profiling_name", "?")).split(":", 1)[-1]


def shape(entry: dict[str, Any]) -> str:
    """An entry's input sizes and dtypes, ``[4] Float``."""
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    return " ".join(f"{list(s)} {d}" for s, d in zip(sizes, dtypes)) or str(sizes)


def stack_call(record: dict[str, Any]) -> tuple[str, str]:
    """The ``torch.distributed`` function the rank's stack is in, and where fn called it."""
    call = record.get("call") or {}
    name = call.get("name", "")
    stack = record.get("stack") or []
    if not name:
        return "", where(user_frame(stack))
    inner = next(
        (i for i, f in enumerate(stack) if str(f.get("filename", "")).endswith(_C10D_FILE)), 0
    )
    return name, where(user_frame(stack[inner:]))


@dataclass
class GroupView:
    """One rank's collectives in one process group.

    Attributes:
        by_seq: sequence number -> the recorder's entry (those still in the ring buffer).
        last: the last sequence number enqueued (0: none).
        started: the last one started (-1 where the backend does not say; gloo never does).
        completed: the last one completed (None where the record does not say).
        pg_id: the recorder's id for the group, the key of its ``pg_status``.
    """

    by_seq: dict[int, dict[str, Any]] = field(default_factory=dict)
    last: int = 0
    started: int = -1
    completed: int | None = None
    pg_id: str = ""

    def waiting(self) -> int | None:
        """The sequence number this rank waits in: its oldest collective not completed.

        gloo runs a rank's collectives one at a time, so that is the last one enqueued; NCCL
        returns at once and the GPU runs them in order, so a rank can have queued several
        behind the one that hangs.
        """
        if self.last <= 0 or (self.completed is not None and self.completed >= self.last):
            return None
        if self.completed is None:
            return self.last
        return max(self.completed, 0) + 1


def _members(records: dict[int, dict[str, Any]], size: int) -> dict[str, set[int]]:
    """Process group name -> its members (global ranks), from every rank's record."""
    members: dict[str, set[int]] = {"0": set(range(size))}
    for record in records.values():
        trace = record.get("trace") or {}
        for name, config in trace.get("pg_config", {}).items():
            if name:  # gloo's recorder files every group under "" (torch 2.14): no use
                ranks = str(config.get("ranks", "")).strip("[]").replace(" ", "")
                members.setdefault(str(name), set()).update(
                    int(r) for r in ranks.split(",") if r.isdigit()
                )
        for name, group in (record.get("groups") or {}).items():
            members.setdefault(str(name), set()).update(group.get("ranks", []))
        for entry in trace.get("entries", []):  # a rank that issued it is a member
            members.setdefault(str(entry["process_group"][0]), set()).add(record["rank"])
    return members


def group_views(records: dict[int, dict[str, Any]], size: int) -> dict[str, dict[int, GroupView]]:
    """Process group name -> member rank -> that rank's view, for the ranks with a trace."""
    traced = {r: rec for r, rec in records.items() if rec.get("trace") is not None}
    ids: dict[str, str] = {}
    for record in traced.values():
        for entry in record["trace"].get("entries", []):
            ids.setdefault(str(entry["process_group"][0]), str(entry.get("pg_id")))
    views: dict[str, dict[int, GroupView]] = {}
    for name, ranks in _members(records, size).items():
        for rank in sorted(ranks & set(traced)):
            views.setdefault(name, {})[rank] = GroupView(pg_id=ids.get(name, ""))
    for rank, record in traced.items():
        for entry in record["trace"].get("entries", []):
            if entry.get("is_p2p"):
                continue
            view = views[str(entry["process_group"][0])][rank]
            view.by_seq[entry["collective_seq_id"]] = entry
            view.pg_id = str(entry.get("pg_id"))
        for group in views.values():
            if rank not in group:
                continue
            view = group[rank]
            status = record["trace"].get("pg_status", {}).get(view.pg_id)
            if status is None:
                view.last = max(view.by_seq, default=0)
                continue
            view.last = max(int(status.get("last_enqueued_collective", 0)), 0)
            view.started = int(status.get("last_started_collective", -1))
            if "last_completed_collective" in status:
                view.completed = int(status["last_completed_collective"])
    return views


def wrapped(record: dict[str, Any]) -> bool:
    """Whether the rank's ring buffer dropped its oldest entries (more than it keeps)."""
    entries = (record.get("trace") or {}).get("entries") or []
    return bool(entries) and min(int(e.get("record_id", 0)) for e in entries) > 0


def entry_where(record: dict[str, Any], entry: dict[str, Any] | None) -> str:
    """Where fn issued ``entry``: torch's frames, else the rank's stack if it is in that call."""
    if entry is None:
        return ""
    found = where(user_frame(entry.get("frames") or []))
    if found:
        return found
    name, place = stack_call(record)
    return place if name and name == op_name(entry) else ""


def group_label(name: str) -> str:
    """How a process group is named after a collective: nothing for the default group."""
    return "" if name == "0" else f" (process group {name})"


def record_notes(
    records: dict[int, dict[str, Any]], views: dict[str, dict[int, GroupView]]
) -> list[str]:
    """What the reader should know about the records themselves."""
    notes = []
    partial = {
        r: len(rec["trace"]["entries"]) for r, rec in sorted(records.items()) if wrapped(rec)
    }
    if partial:
        kept = ", ".join(f"rank {r} the latest {n}" for r, n in partial.items())
        notes.append(
            f"partial records: a recorder keeps only the latest collectives "
            f"(TORCH_FR_BUFFER_SIZE; here {kept}) and dropped older ones; they were compared "
            f"where every rank still has them"
        )
    for rank in sorted(records):
        record = records[rank]
        if record.get("aborted"):
            call, place = stack_call(record)
            gloo = any(g.get("backend") == "gloo" for g in (record.get("groups") or {}).values())
            notes.append(
                f"rank {rank} was aborted (SIGABRT)"
                + (f" in {call}" if call else "")
                + (f" at {place}" if place else "")
                + (
                    ": gloo ends a rank that receives more bytes than its tensor holds "
                    "('Received data size doesn't match expected size'), so the ranks passed "
                    "tensors of different sizes to the same collective"
                    if gloo
                    else ""
                )
            )
    for name, per_rank in views.items():
        for rank, view in sorted(per_rank.items()):
            seq = view.waiting()
            if not seq:
                continue
            entry = view.by_seq.get(seq)
            if entry is None or not str(entry.get("profiling_name", "")).startswith("nccl:"):
                continue
            queued = view.last - seq
            notes.append(
                f"on rank {rank}, {op_name(entry)} #{seq}{group_label(name)} is "
                f"{entry.get('state')} on the GPU and has not completed"
                + (f"; {queued} later collective(s) are queued behind it" if queued else "")
            )
    return notes


def left_no_record(
    rank: int, records: dict[int, dict[str, Any]], views: dict[str, dict[int, GroupView]], size: int
) -> tuple[str, dict[str, Any]]:
    """What the peers' records say of ``rank``, which left none: a line, and a placeholder record.

    The line names, per process group ``rank`` belongs to, its backend and the last collective
    each peer issued in it, with its shapes: the collective the rank most likely died in. The
    placeholder (``trace`` None, ``from_peers`` True) holds those groups and their backends, so
    that a rank ended by SIGABRT on gloo is not blamed on NCCL's watchdog (see
    :func:`~mgtutor.doctor.aborted_on_gloo`).
    """
    members = _members(records, size)
    groups: dict[str, dict[str, Any]] = {}
    said = []
    for name in sorted(n for n, ranks in members.items() if rank in ranks):
        known: dict[str, Any] = next(
            (rec["groups"][name] for rec in records.values() if name in (rec.get("groups") or {})),
            {},
        )
        backend = known.get("backend", "")
        for peer, view in sorted(views.get(name, {}).items()):
            entry = view.by_seq.get(view.last)
            if entry is None:
                continue
            backend = backend or str(entry.get("profiling_name", "")).split(":", 1)[0]
            place = entry_where(records[peer], entry)
            said.append(
                f"rank {peer}'s last collective{group_label(name)} was {op_name(entry)} "
                f"#{view.last} {shape(entry)}" + (f" ({place})" if place else "")
            )
        groups[name] = {"ranks": sorted(members[name]), "backend": backend}
    backends = ", ".join(sorted({g["backend"] for g in groups.values() if g["backend"]}))
    line = f"no record from rank {rank}" + (f" ({backends})" if backends else "")
    line += (": " + "; ".join(said)) if said else ""
    return line, {
        "rank": rank,
        "trace": None,
        "error": "left no record",
        "groups": groups,
        "from_peers": True,
    }
