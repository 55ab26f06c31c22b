"""What a failed, stopped or stuck call tells the learner: the error, its hints, the stacks.

The :class:`~._supervise.Supervisor` decides when a call has failed; this module words it:
:func:`describe` turns a rank's failure (it raised, a signal killed it, it exited early) into a
:class:`~mgtutor.errors.WorkerError`, :func:`diagnose` asks the doctor what the ranks' records
of their collectives say, and :func:`format_stack` turns a rank's faulthandler dump into the
stack a learner reads, in Python's order.
"""

from __future__ import annotations

import linecache
import re
import signal
from dataclasses import dataclass
from typing import Any

from mgtutor.errors import WorkerError
from mgtutor.launcher._handle import RankHandle
from mgtutor.rank.namespace import kept_note
from mgtutor.wire.messages import Failed

__all__ = ["Wording", "describe", "diagnose", "format_stack", "ranks_named", "with_note"]

_MAX_FRAMES = 16

_SIGNAL_HINTS = {
    "SIGKILL": (
        " SIGKILL is what the Linux out-of-memory killer sends: if nobody killed it by hand, the "
        "rank probably ran out of memory (check `dmesg`, or lower the batch size)."
    ),
    "SIGSEGV": " A crash in native code (a C++/CUDA extension, or memory corruption).",
    "SIGABRT": (
        " SIGABRT usually comes from native code giving up: on GPUs, most often NCCL's watchdog "
        "ending the process after a collective timed out or another rank failed (look for "
        "'Watchdog caught collective operation timeout' above). Set TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
        "to have each rank dump its last collectives (torch's Flight Recorder) and read the "
        "dumps with torchfrtrace."
    ),
}

# torch's message when a collective or a rank query runs before init_process_group (torch 2.4
# to 2.14, distributed_c10d._get_default_group).
_NO_GROUP = "Default process group has not been initialized"

_NO_GROUP_HINT = (
    " This rank used torch.distributed before joining a process group: call mgtutor.setup() "
    '(or dist.init_process_group("gloo")) at the start of fn, before any collective or '
    "get_rank()."
)

_GLOO_ABORT_HINT = (
    " On gloo, SIGABRT is gloo giving up: it ends a rank that receives more bytes than its "
    "tensor holds ('Received data size doesn't match expected size' above), when the ranks "
    "passed tensors of different sizes to the same collective."
)


@dataclass(frozen=True)
class Wording:
    """How a launch, a pool or ``%%ddp`` names what ran, in its errors and notes.

    Attributes:
        work: what ran, at the start of a sentence ("fn"; "The %%ddp cell").
        owner: whose processes are gone ("No process of this launch is left running").
        note: added to every error that stopped the ranks ("" for a launch).
        push: how to give the ranks the notebook's values (``{pairs}``: ``name=name, ...``;
            ``{names}``: ``name ...``).
        restart: how to start new ranks.
        kept: whose ranks a failed call keeps ("The pool's ranks"; "The %%ddp ranks").
        sent: what each rank receives before it runs ("fn and its arguments"; "the cell").
    """

    work: str = "fn"
    owner: str = "this launch"
    note: str = ""
    push: str = "pool.push({pairs})"
    restart: str = "pool.restart()"
    kept: str = "The pool's ranks"
    sent: str = "fn and its arguments"


def diagnose(
    handles: list[RankHandle], dump_paths: dict[int, str], wording: Wording | None = None
) -> Any:
    """Ask every live rank for its record of collectives; what the doctor makes of them.

    Ranks that failed sent their record with the failure, a launch's ranks that returned
    sent it with their answer, and a rank that native code aborted wrote it as it died.
    Returns None when there is nothing to compare (no rank made a process group).
    """
    from mgtutor import doctor

    alive = {
        h.rank: h.process.pid
        for h in handles
        if h.process.pid is not None
        and h.process.is_alive()
        and h.rank in dump_paths
        and not h.paused()  # it could not answer: no use waiting for it
    }
    try:
        records: dict[int, Any] = doctor.request_dumps(alive, dump_paths, timeout=1.0)
    except OSError:
        records = {}
    raised = {}
    for h in handles:
        if h.error is not None and h.error.record is not None:
            # Taken as it failed, where it failed: the rank may be elsewhere by now.
            records[h.rank] = h.error.record
        if h.error is not None and h.error.context == "raised":
            message = (h.error.message.splitlines() or [""])[0]
            short = message if len(message) <= 120 else message[:117] + "..."
            raised[h.rank] = f"{h.error.exc_type.rsplit('.', 1)[-1]}: {short}".rstrip(": ")
        sent = h.done.record.get("flight_record") if h.done is not None else None
        if sent is not None:
            records.setdefault(h.rank, sent)  # a launch's rank that answered and exited
    dead = {r: p for r, p in dump_paths.items() if r not in records}
    records.update(doctor.read_final_records(dead))
    traced = {r: rec for r, rec in records.items() if rec.get("trace") is not None}
    no_group = all(not (rec.get("trace") or {}).get("entries") for rec in traced.values())
    in_call = any(rec.get("call") for rec in records.values())  # send/recv: not recorded
    if not records or (traced and no_group and not in_call):
        return None  # no collective was ever issued: nothing to say
    finished = [h.rank for h in handles if h.done is not None]
    try:
        work = (wording or Wording()).work
        return doctor.diagnose(
            records,
            finished=finished,
            raised=raised,
            world_size=len(handles),
            work=work[:1].lower() + work[1:],  # "The %%ddp cell" -> "the %%ddp cell"
        )
    except Exception as exc:  # the doctor must never hide the error it explains
        return doctor.Diagnosis(
            f"the doctor failed on these records ({type(exc).__name__}: {exc})",
            kind="no_recorder",
            records=records,
        )


def describe(h: RankHandle, cleanup: str, diagnosis: Any = None) -> WorkerError:
    """The error that says what happened to rank ``h``: it raised, was killed, or exited."""
    if h.error is not None:
        error = h.error
        original = None
        if error.original is not None:
            try:
                import cloudpickle

                original = cloudpickle.loads(error.original)
            except Exception:
                original = None
        consequence = _consequence(h.rank, diagnosis)
        if consequence is not None:
            # The diagnosis above names the cause; this rank's error (gloo's "Connection closed
            # by peer", its advice and its emoji) is what the cause did to it: its first sentence.
            summary = (
                f"rank {h.rank} ({consequence}) {error.context} {error.exc_type}: "
                f"{_first_sentence(error.message)}"
            )
        elif error.context == "raised":
            summary = f"rank {h.rank} raised {error.exc_type}: {error.message}"
            if _NO_GROUP in error.message:
                summary += _NO_GROUP_HINT
        else:
            summary = f"rank {h.rank} {error.context}: {error.exc_type}: {error.message}"
        return WorkerError(
            summary,
            rank=h.rank,
            exc_type=error.exc_type,
            exc_message=error.message,
            worker_traceback=error.traceback,
            exitcode=h.exitcode,
            cleanup=cleanup,
            original=original,
            diagnosis=diagnosis,
        )
    code = h.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = _SIGNAL_HINTS.get(name, "")
        from mgtutor import doctor

        records = getattr(diagnosis, "records", None) or {}
        if name == "SIGABRT" and doctor.aborted_on_gloo(records.get(h.rank)):
            hint = _GLOO_ABORT_HINT
        summary = f"rank {h.rank} was killed by signal {name} ({-code}).{hint}"
        return WorkerError(
            summary,
            rank=h.rank,
            exitcode=code,
            signal_name=name,
            cleanup=cleanup,
            diagnosis=diagnosis,
        )
    if code == 0:
        summary = f"rank {h.rank} exited without returning a result (its process ended early)."
    else:
        summary = (
            f"rank {h.rank} exited with code {code} before returning a result "
            f"(os._exit, or a failure while the worker started; its last output is above)."
        )
    return WorkerError(summary, rank=h.rank, exitcode=code, cleanup=cleanup, diagnosis=diagnosis)


# The doctor's findings that name a rank that did not reach a collective its peers were in: an
# error a peer then met in that collective is a consequence.
_LEFT_BEHIND = {"raised": "raised", "finished": "returned", "behind": "never reached it"}


def _consequence(rank: int, diagnosis: Any) -> str | None:
    """Why ``rank``'s error follows from another's, when the doctor blames that other rank.

    For example "a consequence: its peer, rank 1, returned"; None when the doctor blames no
    other rank (or says nothing).
    """
    kind = getattr(diagnosis, "kind", None)
    blamed = getattr(diagnosis, "ranks", None) or []
    if kind not in _LEFT_BEHIND or not blamed or rank in blamed:
        return None
    peer = "its peer" if len(blamed) == 1 else "its peers"
    return f"a consequence: {peer}, {ranks_named(blamed)}, {_LEFT_BEHIND[kind]}"


def _first_sentence(message: str) -> str:
    """The first sentence of an error message's first line (all of it when it has one)."""
    line = (message.strip().splitlines() or [""])[0]
    found = re.match(r"(.*?[.!?])(?=\s)", line)
    return found.group(1) if found else line


#: How a rank comes to be stopped, said alike by a timeout and by Stop (pdb is not among them:
#: its breakpoint leaves the process running, waiting for input).
PAUSED_HOW = "paused by SIGSTOP, Ctrl-Z's SIGTSTP or a native debugger such as gdb"


def ranks_named(ranks: list[Any]) -> str:
    """Ranks (numbers or handles) as a phrase: "rank 0", "ranks 0, 2".

    A bare list ("still running: 0") reads as a count of none.
    """
    numbers = [getattr(r, "rank", r) for r in ranks]
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    return f"ranks {', '.join(map(str, numbers))}" if numbers else "no rank"


def with_note(error: Failed, note: str) -> Failed:
    from dataclasses import replace

    return replace(error, traceback=f"{error.traceback.rstrip()}\n\n{note}")


_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')

# Functions below fn on a rank's stack: mgtutor's own start-up and call loop (and %%ddp's
# runner of a cell's code, below the cell).
_ENTRY_FRAMES = ("_run_source", "_measured_call", "_run_call", "rank_main")


def format_stack(dump: bytes, main_ident: int | None) -> str:
    """Pick the main thread out of a faulthandler dump and add each frame's source line."""
    text = dump.decode("utf-8", "replace")
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    chosen = blocks
    if main_ident is not None:
        mark = f"0x{main_ident:016x}"
        # A rank stopped before faulthandler wrote anything leaves an empty dump: no header line.
        chosen = [b for b in blocks if mark in b.partition("\n")[0]] or blocks
    frames: list[str] = []
    for block in chosen:
        for line in block.splitlines()[1:]:
            frame = _FRAME.match(line)
            if frame is None or frame["file"].startswith("<frozen "):
                continue
            text = f'  File "{frame["file"]}", line {frame["line"]}, in {frame["func"]}'
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if frame["func"] in _ENTRY_FRAMES and frames:
                break  # below fn are mgtutor's and multiprocessing's start-up frames
            frames.append(f"{text}\n    {source}" if source else text)
            if frame["func"] in _ENTRY_FRAMES:
                break  # still starting up: mgtutor's own line says what it was doing
    frames.reverse()  # faulthandler lists the innermost frame first; Python's order is last
    if len(frames) > _MAX_FRAMES:
        # Keep the outermost frames (the user's fn) and the innermost (what it waits in).
        hidden = len(frames) - _MAX_FRAMES
        frames = [*frames[: _MAX_FRAMES - 6], f"  ... {hidden} frames omitted ...", *frames[-6:]]
    return "\n".join(frames)


def say_kept_names(handles: list[Any], push: str) -> None:
    """Name the notebook values a call did not use because ranks have their own.

    Args:
        handles: the ranks the call ran on (:class:`~mgtutor.launcher._handle.RankHandle`).
        push: how to send the notebook's values (:attr:`~mgtutor.launcher._report.Wording.push`).
    """
    by_name: dict[str, list[int]] = {}
    for h in handles:
        for name in h.done.record.get("kept", ()) if h.done is not None else ():
            by_name.setdefault(name, []).append(h.rank)
    for ranks in sorted({tuple(r) for r in by_name.values()}):
        names = [n for n, r in by_name.items() if tuple(r) == ranks]
        note = kept_note(names, f"rank(s) {', '.join(map(str, ranks))}")
        advice = push.format(pairs=", ".join(f"{n}={n}" for n in names), names=" ".join(names))
        print(f"mgtutor: {note}. To send the notebook's: {advice}.", flush=True)
