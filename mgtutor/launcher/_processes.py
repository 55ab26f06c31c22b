"""Starting rank processes: the rendezvous store, each rank's environment, the start method.

Ranks start with the *forkserver* start method by default: a server process imports torch once
and forks each rank from it, so only the first start in a session pays for the import; *spawn*
(a fresh interpreter per rank) is offered too. Never plain fork: a forked rank would inherit the
notebook's CUDA state. The notebook's process hosts the rendezvous store on a fresh port of
127.0.0.1, as torchrun's agent does for its workers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mgtutor.hardware import loopback_interface
from mgtutor.launcher import lifetime
from mgtutor.launcher._handle import RankHandle
from mgtutor.launcher._relay import RankOutput
from mgtutor.rank.loop import RankSpec, die_with_parent, rank_main
from mgtutor.wire.messages import Context
from mgtutor.worker import INIT_BARRIER_ENV

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from types import FrameType

    from torch.distributed import TCPStore

    from mgtutor.build import StartMethod

# What the forkserver imports once, so that ranks forked from it need not. torch._dynamo is
# here because DDP's constructor imports it: about 2.4 s per rank on a quiet 2-core machine,
# paid by every launch that builds a DDP model. It starts no thread and asks no CUDA question
# (checked on CPU); tests/test_gpu.py checks on GPUs that the server never initializes CUDA.
# mgtutor.launcher._processes comes first: importing it is what ties the server's life to the
# notebook's (see _die_with_the_notebook_if_server), and the sooner the better.
_FORKSERVER_PRELOAD = (
    "mgtutor.launcher._processes",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "psutil",
    "mgtutor.worker",
    "mgtutor.rank.loop",
    "mgtutor.doctor",
    "mgtutor.measure.memory",
    "mgtutor.measure.timing",
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


_classic_store_needed = False


def host_store(world_size: int) -> TCPStore:
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

    def store_on_a_new_socket(**implementation: Any) -> TCPStore:
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


@contextlib.contextmanager
def main_not_reimported() -> Iterator[None]:
    """Keep spawn from re-running a script's top level in every worker.

    Spawn normally re-imports the parent's ``__main__`` in each child so that functions defined
    there can be found by name; an unguarded ``launch(...)`` at a script's top level would then
    launch again in every worker. fn travels by value here, so the children need nothing from
    ``__main__``: hide its file and spec while the processes start, and restore them after.
    """
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def in_worker_bootstrap() -> bool:
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def worker_environment(world_size: int, backend: str | None, port: int) -> dict[str, str | None]:
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
    if INIT_BARRIER_ENV not in os.environ:
        # Also for a function that calls init_process_group or new_group itself, not setup().
        common[INIT_BARRIER_ENV] = "1"
    loopback = loopback_interface()
    if loopback:
        # One machine: keep gloo's and NCCL's own sockets on loopback too.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                common[name] = loopback
    return common


def start_rank(
    ctx: SpawnContext | ForkServerContext,
    rank: int,
    common: dict[str, str | None],
    context: Context,
    *,
    join_group: bool,
    one_call: bool,
    backend: str | None,
) -> RankHandle:
    """Start one rank process and return the notebook's handle on it."""
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    pipes = {name: ctx.Pipe(duplex=False) for name in ("stdout", "stderr", "diag")}
    started = ctx.RawArray("d", 2)
    spec = RankSpec(
        rank=rank,
        env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        context=context,
        conn=child_conn,
        stdout=pipes["stdout"][1],
        stderr=pipes["stderr"][1],
        diag=pipes["diag"][1],
        start_method=ctx.get_start_method(),
        join_group=join_group,
        backend=backend,
        one_call=one_call,
        parent_pid=_parent_of_ranks(ctx),
        started=started,
    )
    process = ctx.Process(target=rank_main, args=(spec,), name=f"mgtutor-rank-{rank}", daemon=False)
    output = RankOutput(rank, {k: r for k, (r, _) in pipes.items()})
    handle = RankHandle(rank, process, parent_conn, output, started_slot=started)
    try:
        process.start()
    finally:
        # The child holds its own copies now; ours must close or the pipes never reach EOF.
        child_conn.close()
        for _, writer in pipes.values():
            writer.close()
    return handle


def start_server_early() -> None:
    """Start the forkserver now, in the background, unless one runs already.

    Its imports (torch, torch._dynamo, mgtutor's rank code: seconds on a small machine) then
    run on another core during the notebook's first cells; the first launch waits for them only
    if they are not done. It ends with this process, or once idle (:mod:`.lifetime`).
    """
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    _ensure_server()


# Set in this process's environment only while it starts the forkserver, so that the server
# (and no other process) finds its parent's pid in it.
_SERVER_PARENT_ENV = "MGTUTOR_FORKSERVER_PARENT"


def _ensure_server() -> None:
    """Start the forkserver unless it runs, so that it dies when this process dies.

    A rank forked by the server dies with the server (die_with_parent), so the server must die
    with the notebook: the kernel kills it when the thread that started it ends, which for the
    main thread is when the process ends. Started from another thread (which may end first),
    the server is not tied, and ends as multiprocessing's servers do, once no process that may
    use it is left (its "alive" pipe from this process closes: the fallback without Linux).
    """
    import threading
    from multiprocessing import forkserver

    with lifetime.server_starts():  # says so if the idle timeout had stopped it
        if threading.current_thread() is not threading.main_thread():
            forkserver.ensure_running()
            return
        os.environ[_SERVER_PARENT_ENV] = str(os.getpid())
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(_SERVER_PARENT_ENV, None)


def _die_with_the_notebook_if_server() -> None:
    # Runs at import, in every process that imports mgtutor; acts in a forkserver that
    # _ensure_server started, the first module it preloads being this one. The kernel sends
    # SIGTERM, not SIGKILL, so that the server ends each rank's process group first: a rank
    # killed by its own parent-death signal leaves behind the processes its fn started.
    global _server_pid
    parent = os.environ.pop(_SERVER_PARENT_ENV, None)
    if parent is not None and parent.isdigit():
        _server_pid = os.getpid()
        signal.signal(signal.SIGTERM, _end_ranks_then_exit)
        die_with_parent(int(parent), signal.SIGTERM)


_server_pid: int | None = None


def _end_ranks_then_exit(signum: int, frame: FrameType | None) -> None:
    """The forkserver's SIGTERM: kill each rank it forked, with the rank's group, then exit."""
    pid = os.getpid()
    if pid != _server_pid:  # a rank forked before it put back SIGTERM's default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(pid, signal.SIGTERM)
        return
    try:  # the kernel's list: no import, no scan of every process on the machine
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            ranks = [int(p) for p in f.read().split()]
    except OSError:  # no /proc here (macOS): psutil, which the server preloaded
        ranks = _children_from_psutil(pid)
    except ValueError:
        ranks = []
    for rank in ranks:
        for kill in (os.killpg, os.kill):  # a rank leads its own group (os.setpgrp)
            try:
                kill(rank, signal.SIGKILL)
            except OSError:
                pass
    os._exit(0)


def _children_from_psutil(pid: int) -> list[int]:
    try:
        import psutil

        return [child.pid for child in psutil.Process(pid).children()]
    except Exception:
        return []


def _parent_of_ranks(ctx: SpawnContext | ForkServerContext) -> int | None:
    """The parent a rank started with ``ctx`` must die with, or None (see die_with_parent)."""
    import threading

    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        return getattr(forkserver._forkserver, "_forkserver_pid", None)
    # A spawned rank's parent is the thread that starts it: tie the rank only where that
    # thread lives as long as the notebook.
    return os.getpid() if threading.current_thread() is threading.main_thread() else None


def context_for(method: StartMethod) -> Any:
    """The multiprocessing context that starts ranks with ``method``, its server preloaded."""
    # Any: a SpawnContext or ForkServerContext, but torch.multiprocessing types get_context's
    # result as BaseContext, which has no Process.
    import torch.multiprocessing as mp

    ctx = mp.get_context(method)
    if method == "forkserver":
        # Takes effect when the server starts (the first forkserver start in this process, or
        # the first after the server died): it imports these once; every rank is forked from
        # it. __main__ is left out on purpose: a notebook has no file, a script must not re-run.
        ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
        _ensure_server()  # now, so that each rank knows its parent's pid before it starts
    return ctx


_die_with_the_notebook_if_server()
