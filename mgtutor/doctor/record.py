"""A rank's own record of its collectives: turning torch's recorder on and reading it.

torch's Flight Recorder keeps, per process, the latest collectives each process group issued:
for every call its operation (``gloo:all_reduce``), its sequence number in its group, its
input sizes and dtypes, its state, and per group the last sequence number enqueued, started
and completed. It keeps one recorder per kind of backend: gloo's collectives are read with
``_dump_fr_trace``, NCCL's with ``_dump_nccl_trace`` (ProcessGroupNCCL writes to its own).
:func:`own_dump` reads the ones this process uses and adds what the recorder lacks: which
ranks belong to each group, and the Python stack of the main thread with the
``torch.distributed`` call it is in (gloo's recorder does not record send and recv).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

__all__ = ["own_dump", "recorder_available", "recorder_env"]

# The torch.distributed functions whose peer is worth naming (point-to-point calls).
P2P_CALLS = frozenset(
    {"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"}
)
_C10D_FILE = os.path.join("distributed", "distributed_c10d.py")
_PEER_ARGS = ("src", "dst", "group_src", "group_dst", "group_peer")


def recorder_env(buffer_size: int = 2000) -> dict[str, str]:
    """The environment a rank needs for its process group to record its collectives.

    torch reads ``TORCH_FR_BUFFER_SIZE`` (older name: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) once per
    process, when its first process group creates the recorder: set it before
    ``init_process_group``. Unset, it means 2000 entries (read in torch 2.14.1), so the recorder
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


def _frames(frames: list[FrameType]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Frames (outermost first) as the recorder writes them, innermost first; and the call.

    The call is the innermost public ``torch.distributed`` function on the stack, with the
    peer of a point-to-point call and the sizes of the tensor it was given.
    """
    stack = [
        {"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno}
        for f in frames
    ]
    call: dict[str, Any] | None = None
    for frame in reversed(frames):
        code = frame.f_code
        if not code.co_filename.endswith(_C10D_FILE) or code.co_name.startswith("_"):
            continue
        call = {"name": code.co_name}
        try:
            local = dict(frame.f_locals)
        except Exception:  # another thread's frame: its locals are a courtesy, never needed
            local = {}
        for key in _PEER_ARGS:
            if isinstance(local.get(key), int):
                call[key] = local[key]
        tensor = local.get("tensor")
        if tensor is not None and hasattr(tensor, "shape") and hasattr(tensor, "dtype"):
            call["sizes"] = [list(tensor.shape)]
            call["dtypes"] = [str(tensor.dtype).removeprefix("torch.")]
        break
    return list(reversed(stack)), call


def _stack_of(frame: FrameType | None) -> list[FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return list(reversed(frames))


def _traceback_frames(tb: TracebackType | None) -> list[FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _groups() -> dict[str, dict[str, Any]]:
    """Every process group this rank knows: name -> members (global ranks) and backend.

    gloo's recorder files every group under one empty name in its ``pg_config``; torch's
    Python side knows each group's members, including groups this rank never used.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return {}
    world = dist.distributed_c10d._world
    groups = {}
    for pg, name in list(world.pg_names.items()):
        try:
            members = sorted(world.pg_group_ranks[pg])
            backend = str(dist.get_backend(pg))
        except Exception:
            continue
        groups[str(name)] = {"ranks": members, "backend": backend}
    return groups


def _read_recorders(groups: dict[str, dict[str, Any]], stack_traces: bool) -> dict[str, Any]:
    """gloo's recorder, and NCCL's when a group uses NCCL, merged into one dump."""
    import torch

    c10d = torch._C._distributed_c10d
    # torch's stubs do not declare it; recorder_available() checks that this torch has it.
    dump = c10d._dump_fr_trace(includeStackTraces=stack_traces)  # type: ignore[attr-defined]
    dumps = [pickle.loads(dump)]
    kinds = ["gloo"]
    if any("nccl" in g["backend"] for g in groups.values()) and hasattr(c10d, "_dump_nccl_trace"):
        dumps.append(pickle.loads(c10d._dump_nccl_trace(includeStackTraces=stack_traces)))
        kinds.append("nccl")
    trace = {**dumps[0], "entries": [], "pg_status": {}, "pg_config": {}, "recorders": kinds}
    for dump in dumps:
        trace["entries"] += dump.get("entries", [])
        trace["pg_status"].update(dump.get("pg_status", {}))
        trace["pg_config"].update(dump.get("pg_config", {}))
    trace["entries"].sort(key=lambda e: e.get("time_created_ns") or 0)
    return trace


def own_dump(
    *,
    stack_traces: bool = True,
    main_ident: int | None = None,
    tb: TracebackType | None = None,
) -> dict[str, Any]:
    """This rank's record of its collectives, with the Python stack of its main thread.

    Args:
        stack_traces: ask torch for the Python frames that issued each collective. Asked for
            them while a collective was pending, torch 2.14.1's dump once took over 3 s (another
            time 0.6 ms), so the responder thread passes False and sends the main thread's
            stack instead: in a hang, that is where the pending collective was issued.
        main_ident: the thread whose stack to add (default: the main thread).
        tb: take the stack from this traceback instead. Called in the main thread while an
            exception is handled (a rank that failed, as mgtutor's rank loop does), the stack
            is where that exception was raised: the collective the rank was in, if any.

    Returns:
        ``{"rank", "pid", "time", "trace", "stack", "call", "groups", "error"}``: ``trace`` is
        the recorders' dump (``entries``, ``pg_status``; gloo's and NCCL's merged) or None with
        ``error`` saying why; ``stack`` is the frames, innermost first; ``call`` the
        ``torch.distributed`` function the stack is in (None if none); ``groups`` each process
        group's members.

    Example:
        >>> record = own_dump()            # in a rank, after a collective failed
        >>> record["trace"]["pg_status"]
        {'0': {'last_enqueued_collective': 2, ...}}
    """
    if tb is None and main_ident is None and threading.current_thread() is threading.main_thread():
        # Called while an exception is handled (a rank that failed): where it was raised.
        tb = sys.exc_info()[2]
    if tb is not None:
        frames = _traceback_frames(tb)
    else:
        ident = threading.main_thread().ident if main_ident is None else main_ident
        frames = _stack_of(sys._current_frames().get(ident) if ident is not None else None)
    stack, call = _frames(frames)
    del frames
    record: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "time": time.time(),
        "trace": None,
        "stack": stack,
        "call": call,
        "groups": {},
        "error": None,
    }
    available, why = recorder_available()
    if not available:
        record["error"] = why
        return record
    try:
        record["groups"] = _groups()
    except Exception:
        record["groups"] = {}
    try:
        record["trace"] = _read_recorders(record["groups"], stack_traces)
    except Exception as exc:
        record["error"] = f"the recorder's dump failed: {type(exc).__name__}: {exc}"
    return record
