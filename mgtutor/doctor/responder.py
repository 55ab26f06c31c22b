"""The ranks' side of a hang: hand out this rank's record on request, and as it dies.

* In each rank: :func:`start_dump_responder`, early. On request it writes this rank's record
  to a file, even while the main thread is blocked inside a collective (a Python signal
  handler would not run then). It also writes the record when native code aborts the process
  (gloo ends a rank that receives more bytes than it expects, with SIGABRT), so the record of
  the collective that killed it survives the rank.
* In the parent: :func:`request_dumps` asks the ranks and reads their records back;
  :func:`read_final_records` reads what dead ranks left; :func:`remove_dump_files` cleans up.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from mgtutor.doctor.record import own_dump

__all__ = [
    "DUMP_PATH_ENV",
    "default_dump_path",
    "read_final_records",
    "remove_dump_files",
    "request_dumps",
    "start_dump_responder",
]

#: Where a rank's responder writes its record, if set in the rank's environment.
DUMP_PATH_ENV = "MGTUTOR_FR_DUMP"

# The C handler that must outlive start_dump_responder (ctypes frees it with its last reference).
_abort_handler: list[Any] = []


def default_dump_path(pid: int) -> str:
    """Where the responder of process ``pid`` writes, if ``MGTUTOR_FR_DUMP`` is not set."""
    return os.path.join(tempfile.gettempdir(), f"mgtutor-fr-{pid}.pkl")


def _request_path(path: str) -> str:
    return f"{path}.ask"


def _final_path(path: str) -> str:
    return f"{path}.final"


def _write(path: str, blob: bytes) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as out:
        out.write(blob)
    os.replace(partial, path)  # the parent never reads a half-written record


def _respond(ask: int, path: str, main_ident: int) -> None:
    while os.read(ask, 64):  # blocks, with the GIL released, until the parent asks
        try:
            blob = pickle.dumps(own_dump(stack_traces=False, main_ident=main_ident))
        except BaseException as exc:  # the parent must get an answer, not a timeout
            blob = pickle.dumps({"pid": os.getpid(), "trace": None, "error": repr(exc)})
        _write(path, blob)


def _record_on_abort(path: str, main_ident: int) -> None:
    """Write this rank's record to ``path`` if native code aborts the process (SIGABRT).

    A Python signal handler never runs once ``abort()`` has begun; a C handler made with ctypes
    runs in the aborting thread and takes the GIL (free: the main thread waits in the
    collective with it released). The rank then dies of SIGABRT as before. Installed only
    where no GPU is visible (see :func:`_no_gpu`).
    """
    import ctypes

    libc = ctypes.CDLL(None)
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def on_abort(signum: int) -> None:
        try:
            record = own_dump(stack_traces=False, main_ident=main_ident)
            record["aborted"] = True
            _write(_final_path(path), pickle.dumps(record))
        except BaseException:
            pass  # the process is ending either way

    handler = handler_type(on_abort)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, handler_type]
    libc.signal(signal.SIGABRT, handler)
    _abort_handler[:] = [handler]


def start_dump_responder(path: str | None = None) -> str:
    """Start the thread that writes this rank's record to ``path`` whenever the parent asks.

    The parent asks through a named pipe beside ``path`` (``path + ".ask"``, this user's only),
    read by a daemon thread, which answers while the main thread is blocked in a collective (a
    Python signal handler would wait for the collective, in a hang its timeout). If native code
    aborts the process on a machine without GPUs, the record goes to ``path + ".final"``. Call
    it once per process, at any point (before or after the process group exists).

    Args:
        path: the file to write; by default ``$MGTUTOR_FR_DUMP``, else
            :func:`default_dump_path` of this process.

    Returns:
        The path the records go to. Each answer replaces the file whole.
    """
    path = path or os.environ.get(DUMP_PATH_ENV) or default_dump_path(os.getpid())
    ask = _request_path(path)
    for stale in (ask, _final_path(path)):  # left by an earlier process with the same pid
        try:
            os.unlink(stale)
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
    if _no_gpu():
        try:
            _record_on_abort(path, main_ident)
        except (OSError, AttributeError):
            pass  # no C library to ask: a rank that aborts leaves no record
    return path


def _no_gpu() -> bool:
    """Whether this rank can only use gloo: then a handler on SIGABRT cannot stall a rank.

    NCCL's watchdog may abort a rank whose main thread holds the GIL, stuck in a CUDA
    synchronization: the handler would wait for the GIL forever and the rank hang instead of
    dying. gloo's collectives wait with the GIL released.
    """
    if os.environ.get("MGTUTOR_BACKEND") == "nccl":
        return False
    torch = sys.modules.get("torch")
    try:
        return torch is not None and torch.cuda.device_count() == 0
    except Exception:
        return False


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
        rank -> record (see :func:`~mgtutor.doctor.own_dump`), for the ranks that answered in
        time.
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


def aborted_on_gloo(record: Mapping[str, Any] | None) -> bool:
    """Whether a rank that SIGABRT ended used gloo only: then gloo ended it, not NCCL's watchdog.

    Args:
        record: the rank's record: the one its abort handler wrote as it died (see
            :func:`read_final_records`), or, where it left none, the placeholder that
            :func:`~mgtutor.doctor.diagnose` makes from its peers' records (``from_peers``).

    Returns:
        True when every process group the record gives the rank is gloo's.
    """
    record = record or {}
    groups = (record.get("groups") or {}).values()
    if not groups or not (record.get("aborted") or record.get("from_peers")):
        return False
    return all(group.get("backend") == "gloo" for group in groups)


def read_final_records(paths: Mapping[int, str]) -> dict[int, dict[str, Any]]:
    """The records ranks wrote as native code aborted them (see :func:`start_dump_responder`).

    Args:
        paths: rank -> the path its responder writes.

    Returns:
        rank -> record, for the ranks that left one.
    """
    records = {}
    for rank, path in paths.items():
        try:
            with open(_final_path(path), "rb") as final:
                records[rank] = pickle.load(final)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    return records


def remove_dump_files(pids: Mapping[int, int], paths: Mapping[int, str] | None = None) -> None:
    """Remove the request pipes and records the ranks' responders left (after the launch).

    Args:
        pids: rank -> process id.
        paths: rank -> the path its responder wrote (default: :func:`default_dump_path`).
    """
    for rank, pid in pids.items():
        path = (paths or {}).get(rank) or default_dump_path(pid)
        final = _final_path(path)
        for name in (path, _request_path(path), final, f"{path}.{pid}.tmp", f"{final}.{pid}.tmp"):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
