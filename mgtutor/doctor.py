"""Turn every rank's record of its collectives into a diagnosis a learner can act on.

A hang in data-parallel training is almost always a *desync*: the ranks did not call the same
collectives in the same order with the same tensors. torch keeps a record of each rank's
collectives, the Flight Recorder: for every call its operation (``gloo:all_reduce``), its
sequence number in the process group, its input sizes and dtypes and the Python frames that
issued it, and per group the last sequence number enqueued. Read side by side, the records name
the rank that is behind and the collective its peers wait in. In torch 2.14 the recorder runs on
gloo as well as NCCL, and it is on by default (2000 entries; ``TORCH_FR_BUFFER_SIZE=0`` turns it
off).

Three pieces, so that the launcher can wire them in without knowing their inside:

* In each rank: :func:`start_dump_responder`, early. On request it writes this rank's record
  to a file, even while the main thread is blocked inside a collective (a Python signal
  handler would not run then).
* In the parent: :func:`request_dumps` asks the ranks and reads their records back.
* Anywhere: :func:`diagnose` reads the records and says what went wrong, first line first.

:func:`replica_checksums` and :func:`find_drift` catch the quiet bug, replicas that drifted apart.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DUMP_PATH_ENV",
    "Diagnosis",
    "default_dump_path",
    "diagnose",
    "find_drift",
    "own_dump",
    "recorder_available",
    "recorder_env",
    "remove_dump_files",
    "replica_checksums",
    "request_dumps",
    "start_dump_responder",
]

#: Where a rank's responder writes its record, if set in the rank's environment.
DUMP_PATH_ENV = "MGTUTOR_FR_DUMP"

_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")


def _torch_dir() -> str:
    spec = sys.modules.get("torch")
    if spec is not None and getattr(spec, "__file__", None):
        return os.path.dirname(os.path.abspath(spec.__file__))
    import importlib.util

    found = importlib.util.find_spec("torch")
    origin = found.origin if found is not None else None
    return os.path.dirname(os.path.abspath(origin)) if origin else "\0"


_TORCH_DIR = _torch_dir()


# --- turning the recorder on ----------------------------------------------------------------


def recorder_env(buffer_size: int = 2000) -> dict[str, str]:
    """The environment a rank needs for its process group to record its collectives.

    torch reads ``TORCH_FR_BUFFER_SIZE`` (older name: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) once per
    process, when its first process group creates the recorder: set it before
    ``init_process_group``. In torch 2.14 an unset variable means 2000 entries, so the recorder
    is on by default; 0 turns it off.

    Args:
        buffer_size: how many of the latest collectives each rank keeps (a ring buffer).

    Returns:
        Variables to add to the rank's environment.

    Raises:
        ValueError: if ``buffer_size`` is negative.

    Example:
        >>> recorder_env(200)
        {'TORCH_FR_BUFFER_SIZE': '200'}
    """
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 0:
        raise ValueError(f"buffer_size must be a whole number >= 0, got {buffer_size!r}")
    return {"TORCH_FR_BUFFER_SIZE": str(buffer_size)}


def recorder_available() -> tuple[bool, str]:
    """Whether this torch can dump a Flight Recorder record of gloo (and NCCL) collectives.

    Returns:
        ``(True, "")``, or ``(False, why)`` in words that say what to rely on instead.

    Example:
        >>> recorder_available()   # torch 2.14
        (True, '')
    """
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is not None and hasattr(c10d, "_dump_fr_trace"):
        return True, ""
    return False, (
        f"torch {torch.__version__} has no Flight Recorder for gloo "
        f"(torch._C._distributed_c10d._dump_fr_trace is missing; older versions record NCCL "
        f"collectives only): read each rank's Python stack instead"
    )


# --- in a rank: the record, and the thread that hands it out --------------------------------


def _frames_of(frame: Any) -> list[dict[str, Any]]:
    """A Python stack as the recorder writes frames: innermost first, name/filename/line."""
    summary = traceback.extract_stack(frame)
    return [{"name": f.name, "filename": f.filename, "line": f.lineno} for f in reversed(summary)]


def own_dump(*, stack_traces: bool = True, main_ident: int | None = None) -> dict[str, Any]:
    """This rank's record of its collectives, with the Python stack of its main thread.

    Args:
        stack_traces: ask torch for the Python frames that issued each collective. Asked for
            them while a collective was pending, torch 2.14.1's dump once did not return
            within 3 s (another time it took 0.6 ms), so the responder thread passes False and
            sends the main thread's stack instead: in a hang, that is where the pending
            collective was issued.
        main_ident: the thread whose stack to add (default: the main thread).

    Returns:
        ``{"rank", "pid", "time", "trace", "stack", "error"}``: ``trace`` is the recorder's dump
        (a dict with ``entries`` and ``pg_status``) or None with ``error`` saying why; ``stack``
        is that thread's frames, innermost first.

    Example:
        >>> record = own_dump()            # in a rank, after a collective failed
        >>> record["trace"]["pg_status"]
        {'0': {'last_enqueued_collective': 2, ...}}
    """
    ident = threading.main_thread().ident if main_ident is None else main_ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    record: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "time": time.time(),
        "trace": None,
        "stack": _frames_of(frame) if frame is not None else [],
        "error": None,
    }
    available, why = recorder_available()
    if not available:
        record["error"] = why
        return record
    import torch

    try:
        blob = torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=stack_traces)
        record["trace"] = pickle.loads(blob)
    except Exception as exc:
        record["error"] = f"the recorder's dump failed: {type(exc).__name__}: {exc}"
    return record


def default_dump_path(pid: int) -> str:
    """Where the responder of process ``pid`` writes, if ``MGTUTOR_FR_DUMP`` is not set."""
    return os.path.join(tempfile.gettempdir(), f"mgtutor-fr-{pid}.pkl")


def _request_path(path: str) -> str:
    return f"{path}.ask"


def _respond(ask: int, path: str, main_ident: int) -> None:
    while os.read(ask, 64):  # blocks, with the GIL released, until the parent asks
        try:
            blob = pickle.dumps(own_dump(stack_traces=False, main_ident=main_ident))
        except BaseException as exc:  # the parent must get an answer, not a timeout
            blob = pickle.dumps({"pid": os.getpid(), "trace": None, "error": repr(exc)})
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "wb") as out:
            out.write(blob)
        os.replace(partial, path)  # the parent never reads a half-written record


def start_dump_responder(path: str | None = None) -> str:
    """Start the thread that writes this rank's record to ``path`` whenever it is asked.

    The parent asks by writing a byte to a named pipe beside ``path`` (``path + ".ask"``,
    created here, readable by this user only). A daemon thread waits on that pipe; when a byte
    arrives it takes the record with :func:`own_dump` and writes it to ``path``. A collective
    releases the GIL while it waits, so the thread answers while the main thread is blocked in
    one. Nothing here runs in the main thread: a Python signal handler would wait until the
    collective returns, which in a hang is the process group's timeout.

    Safe to call at any point (before or after the process group exists, with other threads
    running); call it once per process.

    Args:
        path: the file to write; by default ``$MGTUTOR_FR_DUMP``, else
            :func:`default_dump_path` of this process.

    Returns:
        The path the records go to. Each answer replaces the file whole (written beside it,
        then renamed).

    Example:
        >>> start_dump_responder()          # in the rank, early
        '/tmp/mgtutor-fr-4242.pkl'
    """
    path = path or os.environ.get(DUMP_PATH_ENV) or default_dump_path(os.getpid())
    ask = _request_path(path)
    try:
        os.unlink(ask)  # left by an earlier process with the same pid
    except FileNotFoundError:
        pass
    os.mkfifo(ask, 0o600)
    # Opened for reading and writing, so the pipe never reports end-of-file between requests.
    fd = os.open(ask, os.O_RDWR)
    main_ident = threading.main_thread().ident
    assert main_ident is not None
    threading.Thread(
        target=_respond, args=(fd, path, main_ident), name="mgtutor-dump-responder", daemon=True
    ).start()
    return path


# --- in the parent: asking for the records --------------------------------------------------


def _ask(path: str) -> bool:
    try:
        fd = os.open(_request_path(path), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no such pipe, or nobody reading it (ENXIO): the rank is gone
        return False
    try:
        os.write(fd, b"?")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def request_dumps(
    pids: Mapping[int, int], paths: Mapping[int, str] | None = None, timeout: float = 2.0
) -> dict[int, dict[str, Any]]:
    """Ask running ranks for their records and read them back.

    A rank without a responder, or one that died, is skipped at once (its request pipe has
    no reader); it is never signalled.

    Args:
        pids: rank -> process id.
        paths: rank -> the path its responder writes (default: :func:`default_dump_path`).
        timeout: seconds to wait for all answers.

    Returns:
        rank -> record (see :func:`own_dump`), for the ranks that answered in time.

    Example:
        >>> records = request_dumps({0: 4242, 1: 4243})
        >>> print(diagnose(records).summary)
        rank 1 never reached all_reduce #2, which rank 0 is waiting in (...)
    """
    waiting = {r: (paths or {}).get(r) or default_dump_path(pid) for r, pid in pids.items()}
    for path in waiting.values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    waiting = {r: path for r, path in waiting.items() if _ask(path)}
    records: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for rank, path in list(waiting.items()):
            try:
                with open(path, "rb") as answer:
                    records[rank] = pickle.load(answer)
            except FileNotFoundError:
                continue
            os.unlink(path)
            del waiting[rank]
        if waiting:
            time.sleep(0.002)
    return records


def remove_dump_files(pids: Mapping[int, int], paths: Mapping[int, str] | None = None) -> None:
    """Remove the request pipes and records the ranks' responders left (after the launch).

    Args:
        pids: rank -> process id.
        paths: rank -> the path its responder wrote (default: :func:`default_dump_path`).
    """
    for rank, pid in pids.items():
        path = (paths or {}).get(rank) or default_dump_path(pid)
        for name in (path, _request_path(path), f"{path}.{pid}.tmp"):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass


# --- reading the records ---------------------------------------------------------------------


@dataclass
class Diagnosis:
    """What the ranks' records say went wrong.

    Attributes:
        summary: one line in plain words (empty problems: the records agree).
        details: further lines: every difference found, where each rank was, torch's analyzer.
        kind: "behind", "finished", "operation", "shape", "dtype", "missing_record",
            "no_recorder" or "agree".
        ranks: the ranks the summary blames.
        seq: the collective's sequence number in its process group (None if not one).
        records: the raw records, rank -> record, for whoever wants to look.
        analyzer: what torch's analyzer (``torch.distributed.flight_recorder``) found, one line
            per collective it could not match, or why it could not run.
    """

    summary: str
    details: list[str] = field(default_factory=list)
    kind: str = "agree"
    ranks: list[int] = field(default_factory=list)
    seq: int | None = None
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    analyzer: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([self.summary, *("  " + line for line in self.details)])


def _as_record(rank: int, dump: Any) -> dict[str, Any]:
    if isinstance(dump, (bytes, bytearray)):
        dump = pickle.loads(dump)
    if not isinstance(dump, dict):
        raise TypeError(f"rank {rank}'s dump must be bytes or a dict, got {type(dump).__name__}")
    if "entries" in dump or "pg_status" in dump:  # torch's own dump, as _dump_fr_trace gives it
        return {"rank": rank, "trace": dump, "stack": [], "error": None}
    return {**dump, "rank": rank}


def _user_frame(frames: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame outside torch, the standard library and mgtutor: the caller's."""
    for frame in frames:
        filename = frame.get("filename", "")
        if filename.startswith((_TORCH_DIR, _STDLIB_DIR, _PACKAGE_DIR)) or filename.startswith("<"):
            continue
        return frame
    return None


def _where(frame: dict[str, Any] | None) -> str:
    if frame is None:
        return ""
    filename, line, name = frame.get("filename", "?"), frame.get("line", "?"), frame.get("name")
    place = f"cell line {line}" if _CELL_FILE.search(filename) else f"{filename}:{line}"
    return f"{place}, in {name}"


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name", "?")).split(":", 1)[-1]


def _shape(entry: dict[str, Any]) -> str:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    return " ".join(f"{list(s)} {d}" for s, d in zip(sizes, dtypes)) or str(sizes)


def _group_view(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per process group name: its collectives by sequence number and the last one enqueued."""
    trace = record["trace"] or {}
    groups: dict[str, dict[str, Any]] = {}
    for entry in trace.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name = str(entry["process_group"][0])
        view = groups.setdefault(name, {"by_seq": {}, "pg_id": str(entry.get("pg_id"))})
        view["by_seq"][entry["collective_seq_id"]] = entry
    for view in groups.values():
        status = trace.get("pg_status", {}).get(view["pg_id"], {})
        view["last"] = status.get("last_enqueued_collective", max(view["by_seq"], default=0))
    return groups


def _entry_where(rank: int, entry: dict[str, Any], records: dict[int, dict[str, Any]]) -> str:
    frame = _user_frame(entry.get("frames") or [])
    if frame is None and entry is _pending(records[rank]) and not _completed(records[rank]):
        # Without torch's own frames, the main thread's stack shows where a collective was
        # issued only while the rank still waits in it.
        frame = _user_frame(records[rank].get("stack") or [])
    return _where(frame)


def _completed(record: dict[str, Any]) -> bool:
    """Whether the rank's last enqueued collective (of its first group) has completed."""
    trace = record.get("trace") or {}
    for status in trace.get("pg_status", {}).values():
        done = status.get("last_completed_collective", -1)
        return done >= status.get("last_enqueued_collective", 0)
    return False


def _pending(record: dict[str, Any]) -> dict[str, Any] | None:
    """The rank's last enqueued collective (where its main thread waits, in a hang)."""
    for view in _group_view(record).values():
        return view["by_seq"].get(view["last"])
    return None


def diagnose(
    dumps: Mapping[int, Any],
    *,
    finished: Collection[int] = (),
    world_size: int | None = None,
) -> Diagnosis:
    """Compare the ranks' records and say in plain words which rank diverged, and how.

    The first difference, in sequence order, is the cause; what follows it is a consequence.
    Differences found: a rank that never reached a collective its peers are in ("behind", or
    "finished" when the caller knows that rank returned from fn), a different operation for
    the same sequence number, different input shapes, different dtypes, and ranks with no
    record (dead, or their torch has no recorder).

    Args:
        dumps: rank -> that rank's record: a :func:`own_dump` dict, the bytes a responder
            wrote, or torch's own ``_dump_fr_trace()`` bytes or dict.
        finished: ranks known to have returned from fn.
        world_size: the number of ranks, if some may be missing from ``dumps``.

    Returns:
        A :class:`Diagnosis`; ``str()`` of it is the message for the learner.

    Example:
        >>> print(diagnose({0: rank0_record, 1: rank1_record}, finished={1}))
        rank 1 finished fn without calling all_reduce #2, which rank 0 is waiting in (...)
    """
    records = {int(r): _as_record(int(r), d) for r, d in dumps.items()}
    ranks = sorted(records)
    size = world_size or (max(ranks) + 1 if ranks else 0)
    absent = [r for r in range(size) if r not in records]
    no_trace = [r for r in ranks if records[r]["trace"] is None]
    if no_trace and len(no_trace) == len(ranks):
        why = records[no_trace[0]].get("error") or "no record"
        return Diagnosis(
            f"no collective record from any rank: {why}",
            kind="no_recorder",
            ranks=no_trace,
            records=records,
        )
    views = {r: _group_view(records[r]) for r in ranks if r not in no_trace}
    problems: list[tuple[int, str, list[int], str, str]] = []  # seq, kind, ranks, first, more
    names = sorted({name for v in views.values() for name in v})
    for name in names:
        per_rank = {r: v[name] for r, v in views.items() if name in v}
        # The ring buffer may have dropped the oldest entries: compare where all ranks have them.
        start = max(min(v["by_seq"], default=0) for v in per_rank.values())
        top = max(v["last"] for v in per_rank.values())
        group = "" if name == "0" else f" (process group {name})"
        for seq in range(start, top + 1):
            have = {r: v["by_seq"][seq] for r, v in per_rank.items() if seq in v["by_seq"]}
            lacking = [r for r, v in per_rank.items() if v["last"] < seq]
            if not have:
                continue
            if lacking:
                waiting = sorted(have)
                entry = have[waiting[0]]
                where = _entry_where(waiting[0], entry, records)
                op = f"{_op(entry)} #{seq}{group}"
                who = " and ".join(f"rank {r}" for r in waiting)
                verb = "is" if len(waiting) == 1 else "are"
                for r in lacking:
                    last = per_rank[r]["by_seq"].get(per_rank[r]["last"])
                    done = r in finished
                    kind = "finished" if done else "behind"
                    head = (
                        f"rank {r} finished fn without calling {op}, which {who} {verb} waiting in"
                        if done
                        else f"rank {r} never reached {op}, which {who} {verb} waiting in"
                    )
                    head += f" ({where})" if where else ""
                    more = (
                        f"rank {r}'s last collective was {_op(last)} #{per_rank[r]['last']}"
                        + (f" ({w})" if (w := _entry_where(r, last, records)) else "")
                        if last
                        else f"rank {r} called no collective{group}"
                    )
                    if not done and records[r].get("stack"):
                        here = _where(_user_frame(records[r]["stack"]))
                        more += f"; it is now at {here}" if here else ""
                    problems.append((seq, kind, [r], head, more))
                continue
            if len(have) < 2:
                continue
            first = min(have)
            for kind in ("operation", "shape", "dtype"):
                if kind == "operation":
                    values = {r: _op(e) for r, e in have.items()}
                elif kind == "shape":
                    values = {r: str(e.get("input_sizes")) for r, e in have.items()}
                else:
                    values = {r: str(e.get("input_dtypes")) for r, e in have.items()}
                if len(set(values.values())) == 1:
                    continue
                odd = sorted(r for r in have if values[r] != values[first])
                listing = ", ".join(
                    f"rank {r} {_op(e)} {_shape(e)}" for r, e in sorted(have.items())
                )
                if kind == "operation":
                    head = "ranks called different collectives as #{}{}: {}".format(
                        seq, group, ", ".join(f"rank {r} {values[r]}" for r in sorted(have))
                    )
                else:
                    word = "shapes" if kind == "shape" else "dtypes"
                    head = f"{_op(have[first])} #{seq}{group} got different {word}: {listing}"
                places = {r: _entry_where(r, e, records) for r, e in sorted(have.items())}
                if len(set(places.values())) == 1 and len(places) > 1:
                    more = f"every rank issued it at {places[first]}" if places[first] else ""
                else:
                    more = "; ".join(f"rank {r} issued it at {w}" for r, w in places.items() if w)
                problems.append((seq, kind, odd, head, more))
                break
    for r in absent:
        problems.append((10**9, "missing_record", [r], f"no record from rank {r}", ""))
    for r in no_trace:
        why = records[r].get("error") or "no record"
        problems.append((10**9, "missing_record", [r], f"no record from rank {r}: {why}", ""))
    analyzer = _run_torch_analyzer(records)
    if not problems:
        return Diagnosis(
            "the ranks' records agree: same collectives, same order, same shapes",
            records=records,
            analyzer=analyzer,
        )
    problems.sort(key=lambda p: p[0])
    seq, kind, blamed, head, more = problems[0]
    details = [more] if more else []
    details += [p[3] + (f" ({p[4]})" if p[4] else "") for p in problems[1:]]
    if absent and kind != "missing_record":
        details.append(
            "ranks with no record (they died, e.g. gloo ends a rank that receives more bytes "
            "than it expects, or did not answer): " + ", ".join(map(str, absent))
        )
    details += [f"torch's analyzer: {line}" for line in analyzer]
    return Diagnosis(
        head,
        details=details,
        kind=kind,
        ranks=blamed,
        seq=None if seq == 10**9 else seq,
        records=records,
        analyzer=analyzer,
    )


def _run_torch_analyzer(records: dict[int, dict[str, Any]]) -> list[str]:
    """Run torch's own matcher (``torch.distributed.flight_recorder``) on the records.

    Its builder looks up each entry's group by ``(entry["process_group"][0], rank)`` in a table
    made from the dump's ``pg_config``. A gloo dump of torch 2.14 files its group in
    ``pg_config`` under an empty name and description while its entries name it ("0",
    "default_pg"), hence the ``KeyError: ('0', 0)`` it raises on gloo dumps as they are. The
    ``pg_config`` is rebuilt here from the entries' names. The matching for the message is
    written out in :func:`diagnose` anyway: the analyzer reports through logging and stops
    pairing a group after its first mismatch, does not read ``pg_status`` (so it cannot tell
    a rank that is behind from one whose oldest entries left the ring buffer), and knows
    nothing of ranks that returned from fn. Its verdicts are kept next to the diagnosis.
    """
    from argparse import Namespace

    try:
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

        log = FlightRecorderLogger().logger  # sets its level when first made
        level = log.level
        log.setLevel(logging.ERROR)  # it logs every mismatch, and a warning if tabulate is missing
        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError as exc:
        return [f"not available in this torch ({exc})"]
    details: dict[str, dict[str, Any]] = {}
    version = ""
    for rank, record in records.items():
        trace = record.get("trace")
        if not trace or not trace.get("entries"):
            continue
        pg_ranks = next(iter(trace.get("pg_config", {}).values()), {}).get("ranks", "[]")
        config = {}
        for entry in trace["entries"]:
            name, desc = entry["process_group"]
            known = trace.get("pg_config", {}).get(name, {})
            config[name] = {"name": name, "desc": desc, "ranks": known.get("ranks", pg_ranks)}
        details[str(rank)] = {**trace, "pg_config": config, "rank": rank}
        version = trace.get("version", version)
    if len(details) < 2:
        log.setLevel(level)
        return []
    args = Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True)
    args.mismatch_cap = 10
    try:
        db = build_db(details, args, version)
    except Exception as exc:
        return [f"could not read these records ({type(exc).__name__}: {exc})"]
    finally:
        log.setLevel(level)
    lines = []
    for coll in db.collectives:
        name = coll.collective_name.split(":", 1)[-1]
        if coll.missing_ranks:
            missing = ", ".join(map(str, sorted(coll.missing_ranks)))
            lines.append(f"{name} #{coll.collective_seq_id}: missing on rank(s) {missing}")
        for rank, other in sorted((coll.mismatch_collectives or {}).items()):
            lines.append(
                f"{name} #{coll.collective_seq_id}: rank {rank} "
                f"{other.type_of_mismatch.state.name if other.type_of_mismatch else 'differs'}"
            )
    return lines


# --- replicas that drift apart ---------------------------------------------------------------


def replica_checksums(module: Any, group: Any = None) -> dict[str, list[float]]:
    """Checksum every parameter and buffer on every rank, so ranks can be compared.

    A collective: every rank of the group must call it. DDP keeps replicas equal only if they
    start equal and receive the same updates; a buffer or parameter changed on one rank alone
    (a BatchNorm statistic with ``broadcast_buffers=False``, an in-place edit under
    ``if rank == 0``) makes them drift without any error.

    Args:
        module: the model (a DDP wrapper or the bare module).
        group: the process group (default: the whole world).

    Returns:
        name -> one checksum per rank (a position-weighted sum in float64), the same on every
        rank.

    Example:
        >>> replica_checksums(model)["0.weight"]
        [-1.7349, -1.7349]
    """
    import torch
    import torch.distributed as dist

    named = list(module.named_parameters()) + list(module.named_buffers())
    rows = []
    for _, tensor in named:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / max(flat.numel(), 1)
        rows.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    local = torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)
    device = "cpu"
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local, device=device) for _ in range(world)]
    dist.all_gather(gathered, local.to(device), group=group)
    table = torch.stack(gathered).cpu()  # [rank, tensor, 2]
    return {
        name: [float(table[r, i, 0] + table[r, i, 1]) for r in range(world)]
        for i, (name, _) in enumerate(named)
    }


def find_drift(module: Any, group: Any = None, rtol: float = 1e-9) -> list[str]:
    """Names of the parameters and buffers that differ between ranks (a collective).

    Args:
        module: the model.
        group: the process group (default: the whole world).
        rtol: relative difference of checksums tolerated (summation order, nothing else).

    Returns:
        The names whose checksum differs between ranks; empty when the replicas agree.

    Example:
        >>> find_drift(model)
        ['1.running_mean']
    """
    drifted = []
    for name, sums in replica_checksums(module, group).items():
        scale = max(abs(s) for s in sums) or 1.0
        if max(sums) - min(sums) > rtol * scale:
            drifted.append(name)
    return drifted
