"""Start DDP workers from a notebook cell and bring back what they printed and returned.

``launch(fn, world_size=2)`` does what torchrun does for a script, from inside a notebook:

1. It checks its arguments and pickles ``fn`` *by value* with cloudpickle, so a function defined
   in a cell, a closure or a lambda reaches the workers (plain ``torch.multiprocessing.spawn``
   pickles functions by name and fails on cell-defined ones).
2. It hosts the rendezvous store itself on a free port of 127.0.0.1, like torchrun's agent, so
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


def _check_arguments(fn: Any, world_size: Any, backend: Any, timeout: Any) -> None:
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
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
    """The text of notebook cells (they have no file), so worker tracebacks can show lines."""
    sources: dict[str, list[str]] = {}
    size = 0
    for filename, entry in list(linecache.cache.items()):
        if len(entry) != 4 or os.path.exists(filename):
            continue
        lines = list(entry[2])
        size += sum(map(len, lines))
        if size > _MAX_SOURCE_BYTES:
            break
        sources[filename] = lines
    return sources


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
    **kwargs: Any,
) -> Run:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` worker processes, one per rank.

    Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT) and should call :func:`mgtutor.setup` to join the process
    group. Lines the workers print appear in the cell as ``[rank 1] ...``. The notebook's own
    ``os.environ`` is left untouched.

    Args:
        fn: the work of one rank; may be defined in a notebook cell, a closure or a lambda.
        *args: positional arguments for fn (pickled; each rank gets its own copy).
        world_size: number of ranks.
        backend: "gloo" or "nccl" for every rank's :func:`mgtutor.setup`; None lets setup pick
            (NCCL with one GPU per rank, else gloo).
        timeout: seconds fn may run, counted from the moment every rank has started it (the
            workers' start-up, mostly importing torch, is not counted; it has its own limit of
            5 minutes). Past it every rank is stopped and :class:`mgtutor.WorkerTimeout` shows
            where each running rank was stuck.
        **kwargs: keyword arguments for fn. (Names world_size, backend and timeout are taken
            by launch itself; pass such arguments with functools.partial.)

    Returns:
        A :class:`mgtutor.Run`; ``run.results[r]`` is what rank r returned.

    Raises:
        WorkerError: a rank raised, exited early or was killed; the other ranks were stopped.
        WorkerTimeout: ``timeout`` passed; every rank was stopped.
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
    _check_arguments(fn, world_size, backend, timeout)
    payload = _pickle_payload(fn, args, kwargs)
    sources = _cell_sources()

    import torch.distributed as dist
    import torch.multiprocessing as mp

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=300),
        master_listen_fd=listener.detach(),
    )
    loopback = _loopback_interface()
    common = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # Like torchrun's agent, the parent hosts the store: ranks connect to it as clients.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if backend:
        common["MGTUTOR_BACKEND"] = backend
    if loopback:
        # One machine: keep gloo's and NCCL's own sockets on loopback too.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                common[name] = loopback

    ctx = mp.get_context("spawn")
    board = ProgressBoard(world_size)
    supervisor = Supervisor(board, timeout)
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


def _start_rank(
    ctx: Any, rank: int, common: dict[str, str], payload: bytes, sources: dict[str, list[str]]
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
