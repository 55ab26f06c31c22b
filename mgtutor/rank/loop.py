"""A rank process's own side: start up, run the calls the notebook sends, answer, exit.

The notebook's :class:`mgtutor.Pool` (and :func:`mgtutor.launch`, a pool that runs one call)
starts each rank with :func:`rank_main`. The rank wires its output to the notebook, installs a
stack dump on SIGUSR1, joins the process group if the pool asked for one, then waits for
:class:`~mgtutor.wire.messages.Call` messages and runs each, until
:class:`~mgtutor.wire.messages.Exit` or the notebook's end. Nothing here is public: the
rank API a training function uses is in :mod:`mgtutor.worker`.
"""

from __future__ import annotations

import atexit
import faulthandler
import linecache
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mgtutor.errors import in_mgtutor, strip_ansi
from mgtutor.rank import channel, namespace
from mgtutor.rank.children import live_children
from mgtutor.rank.result import why_unsendable
from mgtutor.wire.messages import Call, Context, Done, Exit, Failed, Hello, Ready
from mgtutor.wire.pickling import dumps_on_cpu, fails
from mgtutor.worker import (
    current_backend,
    current_device,
    guard_destroy,
    setup,
    share_cores,
    teardown,
)

if TYPE_CHECKING:
    import ctypes
    from types import FrameType

    from mgtutor.measure.breakdown import MemoryBreakdown


@dataclass
class RankSpec:
    """What the notebook hands one rank process (pickled by multiprocessing at its start)."""

    rank: int
    env: dict[str, str | None]  # the rank's own variables; None removes one
    context: Context  # the notebook's, when the rank started
    conn: Connection
    stdout: Connection
    stderr: Connection
    diag: Connection
    start_method: str
    join_group: bool  # a pool joins the process group once, before any call
    backend: str | None
    one_call: bool  # launch: the rank exits after a failed call instead of waiting for more
    # The process that forked this rank, whose death must end it (see die_with_parent); None
    # where the forking thread may end before the notebook does.
    parent_pid: int | None = None
    # Shared with the notebook: [number of the call whose fn started, when]. The notebook
    # reads it when it checks its limits, so a call's start costs it no message and no wakeup.
    started: ctypes.Array[ctypes.c_double] | None = None


_keep_alive: list[Connection] = []
_in_call = [False]  # read by the SIGINT handler; a flag, as an Event's lock cost 3 us a call
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent: int | None, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` when ``parent`` dies (Linux); False where it cannot.

    Unlike a thread that watches a pipe, this needs nothing of the process itself: it holds
    even for code stuck in native code with the GIL held. The kernel signals when the thread
    that forked this process ends, which is why ``parent`` is None where that thread might end
    before its process. If the parent died before the request was made, this process already
    has another parent that will never signal it: it ends at once.
    """
    if parent is None or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True


def _redirect_output(stdout: Connection, stderr: Connection) -> None:
    # At the descriptor level, so C++ warnings, NCCL logs and subprocesses are relayed too.
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    stdout.close()
    stderr.close()
    # typeshed marks sys.__stdout__ Final; a rank replaces it on purpose, for good.
    sys.stdout = sys.__stdout__ = open(  # type: ignore[misc]  # noqa: SIM115 - process-long
        1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )
    sys.stderr = sys.__stderr__ = open(  # type: ignore[misc]  # noqa: SIM115
        2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
    )


def _messages(conn: Connection) -> Iterator[Call | Exit]:
    """The notebook's messages, read by the main thread; the rank ends if the notebook is gone.

    End of file on the pipe means the notebook's process died (a kernel restart, kill -9):
    take this rank and its own children down rather than leave orphans holding memory or ports.
    While fn runs, a thread notices that too. On Linux it waits for the pipe's hang-up alone
    (``POLLRDHUP``), so messages go straight to the main thread; elsewhere it reads every
    message and passes it on (one thread hop per call). Neither thread can run while the main
    thread holds the GIL in native code: on Linux the kernel ends the rank then
    (:func:`die_with_parent`); on macOS nothing does.
    """
    if hasattr(select, "POLLRDHUP"):
        threading.Thread(target=_wait_for_hangup, args=(conn,), daemon=True).start()
        return _received(conn)
    commands: queue.Queue[Call | Exit | None] = queue.Queue()
    threading.Thread(target=_listen, args=(conn, commands), daemon=True).start()
    return iter(commands.get, None)


def _received(conn: Connection) -> Iterator[Call | Exit]:
    while True:
        try:
            yield conn.recv()
        except (EOFError, OSError):
            os.killpg(0, signal.SIGKILL)


def _wait_for_hangup(conn: Connection) -> None:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)  # not POLLIN: data is the main thread's
    while True:
        events = [e for _, e in poller.poll()]
        if any(e & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for e in events):
            os.killpg(0, signal.SIGKILL)


def _listen(conn: Connection, commands: queue.Queue[Call | Exit | None]) -> None:
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):
        pass
    os.killpg(0, signal.SIGKILL)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # The notebook sends SIGINT to interrupt a call (Ctrl+C in a pool); between calls it is
    # ignored, so an interrupt that arrives late cannot end the rank.
    if _in_call[0]:
        raise KeyboardInterrupt


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _failure(exc: BaseException, context: str, call: int) -> Failed:
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None
    # The frames below fn (%%ddp's runner of a cell) are mgtutor's, not the learner's.
    while tb is not None and tb.tb_next is not None and _is_mgtutor(tb.tb_frame):
        tb = tb.tb_next
    # Plain text, whatever colour a message carries (strip_ansi says where colour comes from):
    # the notebook's side reads the last line and the first sentence out of it.
    text = strip_ansi("".join(traceback.format_exception(type(exc), exc, tb)))
    try:
        import cloudpickle

        original: bytes | None = cloudpickle.dumps(exc)
    except Exception:
        original = None
    exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    message = strip_ansi(str(exc))
    return Failed(
        call, exc_type, message, text, original, context, time.perf_counter(), _own_record()
    )


def _is_mgtutor(frame: FrameType) -> bool:
    return in_mgtutor(frame.f_code.co_filename)


def _own_record() -> dict[str, Any] | None:
    """This rank's record of its collectives, for the doctor, if it made a process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        from mgtutor import doctor

        return doctor.own_dump(stack_traces=False)
    except Exception:
        return None


def _apply_context(context: Context, own: dict[str, str | None]) -> None:
    """Give this rank the notebook's environment, folder and import path, then its own."""
    os.environ.clear()
    os.environ.update(context.environ)
    for name, value in own.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        os.chdir(context.cwd)
    except OSError:
        pass  # the notebook's folder was removed; stay where the rank is
    sys.path[:] = context.sys_path
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "set_debug_level_from_env"):
        # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported (in the
        # forkserver, maybe before the notebook set it): read the notebook's value now.
        try:
            dist.set_debug_level_from_env()
        except (RuntimeError, ValueError):
            pass  # an invalid value: torch's own error comes when the group is made


def _tracked_breakdown() -> MemoryBreakdown | None:
    """fn's tracked model and optimizer by category (mgtutor.track); None if none was tracked."""
    from mgtutor.measure.breakdown import tracked_breakdown

    try:
        return tracked_breakdown()
    except Exception as exc:  # the run's result matters more than its memory plot
        print(f"mgtutor: could not break down the tracked memory: {exc!r}", file=sys.stderr)
        return None


def _run_call(call: Call, spec: RankSpec) -> Done | Failed:
    """Run one call: unpack fn, run it, measure it, pickle what it returned."""
    if call.context is not None:
        _apply_context(call.context, spec.env)
    for filename, lines in call.sources.items():
        # Cells have no file on disk; with their text here, tracebacks show the failing line.
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    namespace.begin_call()
    try:
        fn, args, kwargs = _unpacked(call)
        if call.in_namespace:
            fn = namespace.in_rank_namespace(fn)
    except BaseException as exc:
        return _failure(exc, "could not unpack the function and its arguments", call.call)
    answer = _measured_call(fn, args, kwargs, call, spec)
    kept = namespace.kept_names()
    if kept and isinstance(answer, Failed):
        # The notebook says it for a call that finished (Done's record); here, where it failed.
        print(f"mgtutor: {namespace.kept_note(kept)}")  # a note, not an error
    return answer


_last_unpacked: list[Any] = [None, None]  # the last reusable payload, and what it gave


def _unpacked(call: Call) -> Any:
    """``(fn, args, kwargs)`` from the call's payload; unpickled again only if it changed.

    A payload the notebook marked reusable holds only values that cannot change in place, and
    a call in the rank's namespace runs a new function made from fn (``_namespace``), never fn
    itself: what the last identical payload gave serves again.
    """
    if call.reusable and call.in_namespace and call.payload == _last_unpacked[0]:
        return _last_unpacked[1]
    import cloudpickle

    unpacked = cloudpickle.loads(call.payload)
    if call.reusable and call.in_namespace:
        _last_unpacked[:] = [call.payload, unpacked]
    return unpacked


def _measured_call(
    fn: Callable[..., Any], args: tuple, kwargs: dict, call: Call, spec: RankSpec
) -> Done | Failed:
    """Run fn once, measuring time and memory; Done with its pickled result, or Failed."""
    from mgtutor.measure import breakdown, memory, timing

    rss_start = memory.current_rss()
    peak_was_reset = memory.reset_peak_rss()
    memory.reset_cuda_peaks()
    breakdown.reset_tracked_peak()  # a pool's earlier calls' activations are not this call's
    timing.collect_records(clear=True)  # a pool's earlier calls are not this call's
    started = time.perf_counter()
    if spec.started is not None:
        spec.started[1] = started
        spec.started[0] = call.call
    _in_call[0] = True
    try:
        result = fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return _failure(exc, "called sys.exit with a failure code", call.call)
        result = None
    except KeyboardInterrupt as exc:
        return _failure(exc, "was interrupted", call.call)
    except BaseException as exc:
        return _failure(exc, "raised", call.call)
    finally:
        _in_call[0] = False
    finished = time.perf_counter()
    try:
        device = current_device()
        record = {
            "pid": os.getpid(),
            "device": device,
            "backend": current_backend(),
            "started": started,
            "finished": finished,
            "memory": memory.measure(device, rss_start, peak_was_reset),
            "breakdown": _tracked_breakdown(),
            "timings": timing.collect_records(clear=True),
            "children": live_children(),
            "kept": namespace.kept_names(),
        }
        if spec.one_call:
            # A launch's rank answers and exits, as its peers do: its record of collectives goes
            # with the answer (for the doctor, should a peer hang), then it leaves the group.
            record["flight_record"] = _own_record()
            teardown()
        blob = dumps_on_cpu(result)
    except BaseException as exc:
        sent = "finished, but its result could not be sent back"
        if not isinstance(exc, Exception) or not fails(result):
            return _failure(exc, sent, call.call)
        message, where = why_unsendable(fn, result, exc)  # not cloudpickle's frames
        exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        return Failed(call.call, exc_type, message, where, None, sent, time.perf_counter())
    return Done(call.call, blob, record)


def _start_doctor() -> None:
    """Answer the notebook's requests for this rank's record of collectives (mgtutor.doctor)."""
    from mgtutor import doctor

    path = os.environ.get(doctor.DUMP_PATH_ENV)
    if not path:
        return
    try:
        doctor.start_dump_responder(path)
    except OSError:
        pass  # no named pipes here: a hang is then explained by the stacks alone


def rank_main(spec: RankSpec) -> None:
    """The rank process: start up, join the group if asked, run calls until told to exit."""
    die_with_parent(spec.parent_pid)  # first: a rank must never outlive its notebook
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the forkserver's (see _processes)
    os.setpgrp()  # one process group per rank, so cleanup reaches the rank's own children
    signal.signal(signal.SIGINT, _interrupt)
    _redirect_output(spec.stdout, spec.stderr)
    faulthandler.register(signal.SIGUSR1, file=spec.diag.fileno(), all_threads=True)
    _keep_alive.append(spec.diag)
    channel.attach(spec.conn)
    messages = _messages(spec.conn)
    channel.send(Hello(os.getpid(), threading.main_thread().ident or 0))
    _apply_context(spec.context, spec.env)
    share_cores()  # as torchrun's OMP_NUM_THREADS=1 does, whether or not fn calls setup()
    guard_destroy()
    _start_doctor()
    if spec.join_group:
        try:
            setup(spec.backend)
        except BaseException as exc:
            channel.send(_failure(exc, "could not join the process group", 0))
            _flush()
            os._exit(1)
    channel.send(Ready(current_backend()))  # setup's choice; None where no group was made
    for message in messages:
        if isinstance(message, Exit):
            break
        answer = _run_call(message, spec)
        _flush()  # all fn printed is in the pipes before the answer (see _relay)
        channel.send(answer)
        if isinstance(answer, Failed) and spec.one_call:
            _flush()
            os._exit(1)
        if spec.one_call:
            break  # a launch runs one call: exit now, with the peers, instead of waiting
    teardown()
    _flush()
    if spec.start_method == "forkserver":
        # A forkserver child ends with os._exit, which skips atexit handlers; a spawned one
        # runs them. Run them here so fn's atexit code behaves the same with both.
        try:
            atexit._run_exitfuncs()
        finally:
            _flush()
