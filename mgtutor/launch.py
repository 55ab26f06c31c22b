"""Start DDP workers from a notebook cell and bring back what they printed and returned.

``launch(fn, world_size=2)`` does what torchrun does for a script, from inside a notebook:

1. It checks its arguments and pickles ``fn`` *by value* with cloudpickle, so a function defined
   in a cell, a closure or a lambda reaches the workers (plain ``torch.multiprocessing.spawn``
   pickles functions by name and fails on cell-defined ones).
2. It hosts the rendezvous store itself on a fresh port of 127.0.0.1, like torchrun's agent, so
   no fixed port can be left taken by a crashed run and nothing listens beyond this machine.
3. It starts ``world_size`` processes with the *spawn* start method (never fork, so a notebook
   that already used CUDA can launch), each with torchrun's environment contract.
4. While they run, it relays every line they print into the cell, prefixed with the rank, and
   shows their progress; it stops all of them as soon as one fails, hangs past ``timeout`` or
   the cell is interrupted, and leaves no process behind (see :mod:`mgtutor._supervise`).
"""

from __future__ import annotations

import contextlib
import datetime
import linecache
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from mgtutor._supervise import RankHandle, Supervisor
from mgtutor.errors import WorkerError
from mgtutor.progress import ProgressBoard
from mgtutor.run import RankResult, Run
from mgtutor.timing import PhaseRecord
from mgtutor.worker import BACKENDS, WorkerSpec, _worker_entry

__all__ = ["launch"]

_MAX_SOURCE_BYTES = 2_000_000


def _check_arguments(
    fn: Any, world_size: Any, backend: Any, timeout: Any, start_timeout: Any
) -> None:
    if not callable(fn):
        raise TypeError(f"launch needs a function to run in every worker, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a whole number, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (one worker per rank), got {world_size}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS} or None (choose for me), got {backend!r}"
        )
    for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
        ):
            raise ValueError(
                f"{name} must be a positive number of seconds or None (no limit), got {value!r}"
            )
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        # device_count() asks NVML and leaves CUDA uninitialized in the notebook's process
        # (is_available() would initialize it, which breaks fork-based tools used later).
        gpus = torch.cuda.device_count()
        if gpus < world_size or not dist.is_nccl_available():
            why = (
                "this torch has no NCCL"
                if not dist.is_nccl_available()
                else f"CUDA sees {gpus} GPU(s)"
            )
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size}, but {why}. "
                f"Use backend='gloo' (or None to choose automatically), or world_size<={gpus}."
            )


def _pickle_payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        culprit = "the function (or a global or closure variable it uses)"
        parts: list[tuple[str, Any]] = [("fn", fn)]
        parts += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
        for name, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception:
                culprit = name if name != "fn" else culprit
                break
        raise pickle.PicklingError(
            f"mgtutor.launch could not send {culprit} to the workers: {exc}. Each worker is a "
            f"new process and gets a pickled copy; create objects such as locks, open files, "
            f"sockets or generators inside the function instead of passing them in."
        ) from exc


def _cell_sources() -> dict[str, list[str]]:
    """The text of notebook cells (they have no file), so worker tracebacks can show lines.

    IPython adds each executed cell to ``linecache`` under a name of its own, oldest first.
    The newest cells are the ones a launch most likely runs, so they are taken first, up to a
    size limit that keeps a long session's history from slowing every launch.
    """
    sources: dict[str, list[str]] = {}
    size = 0
    for filename, entry in reversed(list(linecache.cache.items())):
        if len(entry) != 4 or entry[1] is not None or os.path.exists(filename):
            continue
        lines = list(entry[2])
        cost = sum(map(len, lines))
        if size + cost > _MAX_SOURCE_BYTES:
            continue
        size += cost
        sources[filename] = lines
    return sources


_classic_store_needed = False


def _host_store(world_size: int) -> Any:
    """Host the rendezvous store in this process, listening on 127.0.0.1 only.

    A store that rank 0 hosts (plain ``env://``) listens on every interface, and a port chosen
    in advance may be taken by the time rank 0 binds it. Here the socket is bound to a free
    port of the loopback address first and handed to the store, as torchrun's agent does.
    torch's libuv store takes such a socket only in newer versions; older ones need the
    classic store implementation for it.
    """
    global _classic_store_needed
    import torch.distributed as dist

    def listening_socket() -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        return listener

    options: dict[str, Any] = {
        "world_size": world_size,
        "is_master": True,
        "wait_for_workers": False,
        "timeout": datetime.timedelta(seconds=300),
    }

    def store_on_a_new_socket(**implementation: Any) -> Any:
        listener = listening_socket()
        port = listener.getsockname()[1]
        fd = listener.detach()  # the store owns it from here
        try:
            return dist.TCPStore(
                "127.0.0.1", port, master_listen_fd=fd, **options, **implementation
            )
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise

    if not _classic_store_needed:
        try:
            return store_on_a_new_socket()
        except (NotImplementedError, RuntimeError) as exc:
            if "listen fd" not in str(exc) and "libuv" not in str(exc):
                raise
        _classic_store_needed = True  # ask once per session (the refusal also prints a log line)
    return store_on_a_new_socket(use_libuv=False)


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Keep spawn from re-running a script's top level in every worker.

    Spawn normally re-imports the parent's ``__main__`` in each child so that functions defined
    there can be found by name; an unguarded ``launch(...)`` at a script's top level would then
    launch again in every worker. fn travels by value here, so the children need nothing from
    ``__main__``: hide its file and spec while the processes start, and restore them after.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _in_worker_bootstrap() -> bool:
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str | None = None,
    timeout: float | None = None,
    start_timeout: float | None = 300.0,
    start_method: str | None = None,
    **kwargs: Any,
) -> Run:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` worker processes, one per rank.

    Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT) and joins the process
    group with :func:`mgtutor.setup` or with a plain ``dist.init_process_group("gloo")``: the
    notebook's process hosts the rendezvous store on a fresh port of 127.0.0.1, as torchrun's
    agent does for its workers (``TORCHELASTIC_USE_AGENT_STORE``). Lines the workers print
    appear in the cell as ``[rank 1] ...``. The notebook's own ``os.environ`` is left untouched.

    Args:
        fn: the work of one rank; may be defined in a notebook cell, a closure or a lambda.
        *args: positional arguments for fn (pickled; each rank gets its own copy).
        world_size: number of ranks.
        backend: "gloo" or "nccl" for every rank's :func:`mgtutor.setup`; None lets setup pick
            (NCCL with one GPU per rank, else gloo).
        timeout: seconds fn may run, counted from the moment every rank has started it; None
            (the default) means no limit. Past it every rank is stopped and
            :class:`mgtutor.WorkerTimeout` shows where each running rank was stuck.
        start_timeout: seconds the ranks may take to start (Python's start, imports,
            unpickling fn and its arguments) before fn runs; None means no limit. The default
            of 5 minutes is generous for a laptop; a cluster node importing torch from a
            network file system may need more.
        start_method: how the rank processes start. "forkserver" (the default): a server
            process that has imported torch once, and never touched CUDA, forks each rank;
            after the first launch in a session a rank starts in a fraction of a second.
            "spawn": every rank is a fresh interpreter that imports torch itself (about a
            second or more per launch). Both are safe after CUDA was used in the notebook;
            plain "fork" is not, and is refused.
        **kwargs: keyword arguments for fn. (Names world_size, backend, timeout,
            start_timeout and start_method are taken by launch itself; pass such arguments
            with functools.partial.)

    Returns:
        A :class:`mgtutor.Run`; ``run.results[r]`` is what rank r returned. Tensors on a GPU
        come back on the CPU (moved in the rank before sending), so the notebook's own process
        never initializes CUDA to read them.

    Raises:
        WorkerError: a rank raised, exited early or was killed; the other ranks were stopped.
        WorkerTimeout: ``timeout`` or ``start_timeout`` passed; every rank was stopped.
        pickle.PicklingError: fn or an argument cannot be sent to a worker (nothing started).
        ValueError, TypeError: bad arguments (nothing started).

    Example:
        >>> def work(scale):
        ...     mgtutor.setup()
        ...     t = torch.ones(1) * (dist.get_rank() + 1) * scale
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> mgtutor.launch(work, 10, world_size=2).results
        [30.0, 30.0]
    """
    if _in_worker_bootstrap():
        raise RuntimeError(
            "mgtutor.launch() was called while a worker process was starting up. Put the code "
            'that launches under `if __name__ == "__main__":` in your script.'
        )
    _check_arguments(fn, world_size, backend, timeout, start_timeout)
    method = start_method or DEFAULT_START_METHOD
    if method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {START_METHODS} (or None for "
            f"{DEFAULT_START_METHOD!r}), got {start_method!r}. 'fork' is not offered: a forked "
            f"rank inherits the notebook's CUDA state and fails once CUDA was used there."
        )
    payload = _pickle_payload(fn, args, kwargs)
    sources = _cell_sources()

    import torch.multiprocessing as mp

    store = _host_store(world_size)
    common = _worker_environment(world_size, backend, store.port)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Takes effect when the server starts (the first forkserver launch in this process, or
        # the first after the server died): it imports these once; every rank is forked from
        # it. __main__ is left out on purpose: a notebook has no file, a script must not re-run.
        ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    board = ProgressBoard(world_size)
    supervisor = Supervisor(board, timeout, start_timeout)
    started = time.perf_counter()
    try:
        with _main_not_reimported():
            for rank in range(world_size):
                supervisor.add(_start_rank(ctx, rank, common, payload, sources))
        outcome = supervisor.run()
    finally:
        supervisor.close()
        del store
    finished = time.perf_counter()
    return _build_run(outcome, world_size, started, finished)


START_METHODS = ("forkserver", "spawn")
DEFAULT_START_METHOD = "forkserver"
# What the forkserver imports once, so that ranks forked from it need not. torch._dynamo is
# here because DDP's constructor imports it: about 2.4 s per rank on a quiet 2-core machine,
# paid by every launch that builds a DDP model. Importing it starts no thread and asks no CUDA
# question (checked on CPU); tests/test_gpu.py checks on GPUs that the server never loads libcuda.
_FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "psutil",
    "mgtutor.worker",
    "mgtutor.memory",
    "mgtutor.timing",
)


# Variables a launcher of the notebook's own process may have left in os.environ that would
# send this launch's ranks to the wrong rendezvous (torchrun's agent store, a SLURM job's).
_INHERITED_RENDEZVOUS = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
)


def _worker_environment(world_size: int, backend: str | None, port: int) -> dict[str, str | None]:
    """The variables every rank of one launch gets; None removes a variable in the rank."""
    common: dict[str, str | None] = dict.fromkeys(_INHERITED_RENDEZVOUS)
    common.update(
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # What torchrun's agent tells its workers: the store at MASTER_ADDR:MASTER_PORT is
        # hosted for you, join it as a client (env:// reads this; so does a plain
        # init_process_group). torch 2.4 also reads the restart count on that path.
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        MGTUTOR_BACKEND=backend,
    )
    loopback = _loopback_interface()
    if loopback:
        # One machine: keep gloo's and NCCL's own sockets on loopback too.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                common[name] = loopback
    return common


def _start_rank(
    ctx: Any,
    rank: int,
    common: dict[str, str | None],
    payload: bytes,
    sources: dict[str, list[str]],
) -> RankHandle:
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    pipes = {name: ctx.Pipe(duplex=False) for name in ("stdout", "stderr", "diag")}
    spec = WorkerSpec(
        env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        payload=payload,
        conn=child_conn,
        stdout=pipes["stdout"][1],
        stderr=pipes["stderr"][1],
        diag=pipes["diag"][1],
        sources=sources,
        environ=dict(os.environ),
        cwd=os.getcwd(),
        sys_path=list(sys.path),
        start_method=ctx.get_start_method(),
    )
    process = ctx.Process(
        target=_worker_entry, args=(rank, spec), name=f"mgtutor-rank-{rank}", daemon=False
    )
    handle = RankHandle(rank, process, parent_conn, {k: r for k, (r, _) in pipes.items()})
    try:
        process.start()
    finally:
        # The child holds its own copies now; ours must close or the pipes never reach EOF.
        child_conn.close()
        for _, writer in pipes.values():
            writer.close()
    return handle


def _build_run(handles: list[RankHandle], world_size: int, started: float, finished: float) -> Run:
    import cloudpickle

    ranks = []
    for h in handles:
        blob, record = h.done
        try:
            result = cloudpickle.loads(blob)
        except Exception as exc:
            raise WorkerError(
                f"rank {h.rank} finished, but the notebook could not unpickle its result: {exc}. "
                f"Return plain values (numbers, lists, dicts, tensors) from fn.",
                rank=h.rank,
            ) from exc
        timings = [
            PhaseRecord(p.name, p.step, p.start - started, p.end - started, p.samples, p.nbytes)
            for p in record["timings"]
        ]
        ranks.append(
            RankResult(
                rank=h.rank,
                pid=record["pid"],
                device=record["device"],
                backend=record["backend"],
                wall_time_s=record["finished"] - record["started"],
                memory=record["memory"],
                result=result,
                timings=timings,
            )
        )
    return Run(world_size=world_size, ranks=ranks, wall_time_s=finished - started)
