"""Ranks that stay alive between cells: build a DDP model in one cell, step it in the next.

A :class:`Pool` starts ``world_size`` rank processes once, has them join the process group
once, and keeps them. Each :meth:`Pool.run` sends a function to every rank (or some) and returns
the same :class:`mgtutor.Run` as :func:`mgtutor.launch`: results, relayed output, timing and
memory. What a call leaves in a rank's global namespace is there for the next call::

    pool = mgtutor.Pool(world_size=2)

    def build():
        global model, opt
        model = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    pool.run(build)
    pool.run(lambda: model.module.weight.sum().item()).results   # the same on both ranks
    pool.close()

:func:`mgtutor.launch` is a pool that runs one call and closes (its class, in
:mod:`.launch`, changes only when the ranks start and whether they outlive the call), so the
two check their arguments, relay output, report faults and clean up in the same way. In a
notebook, ``%load_ext mgtutor`` adds the ``%%ddp`` cell magic on top of a pool
(:mod:`mgtutor.launcher.magic`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mgtutor.doctor import DUMP_PATH_ENV
from mgtutor.errors import ArgumentError, PoolClosed
from mgtutor.launcher import (
    _arguments,
    _cleanup,
    _handle,
    _payload,
    _processes,
    _report,
    _send,
    lifetime,
)
from mgtutor.launcher._report import Wording
from mgtutor.launcher._supervise import Supervisor
from mgtutor.launcher.progress_bars import ProgressBoard
from mgtutor.launcher.run import Run
from mgtutor.rank import namespace
from mgtutor.wire.messages import Call, Exit

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from mgtutor.build import StartMethod

__all__ = ["Pool"]

_POOL_NOTE = (
    "The pool's ranks were stopped; its next call starts new ones (what they held is lost)."
)


# Pools not closed yet. At interpreter exit they are closed before multiprocessing's own exit
# handler (registered earlier, so it runs later) joins every non-daemon child process: without
# this, a script or kernel that ends without pool.close() would wait forever for ranks that
# wait for their next call.
_open_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        try:
            pool.close()
        except BaseException:
            pass


class Pool:
    """``world_size`` ranks started once and kept, each with its own namespace.

    The namespace rule: a rank's own names (what its calls assign with ``global``, what
    ``push`` sets, what ``%%ddp`` cells assign) are never replaced; any other name fn reads
    comes from the notebook, as it is at the call. So ``lr = 0.1`` in the notebook reaches a
    function that reads ``lr``, and ``lr = 0.2`` reaches the next call; a ``model`` that an
    earlier call made on the ranks stays theirs even if the notebook defines a ``model`` of its
    own (the notebook says, on stderr, when a value it has was not used for that reason); and
    ``push`` always takes effect. To replace a rank's own name, push it or assign it in a call.

    Args:
        world_size: number of ranks.
        backend: "gloo" or "nccl"; None takes the notebook's MGTUTOR_BACKEND where it is set,
            else each rank picks NCCL with one GPU per rank, else gloo. Once the ranks have
            joined their group, ``pool.backend`` is the one they chose, as they say it.
        start_timeout: seconds the ranks may take to start and join the process group, and
            each call to unpickle fn; None means no limit.
        start_method: "forkserver" (the default on Linux) or "spawn" (the default and only
            choice on macOS), as for :func:`mgtutor.launch`.
        join_group: join the default process group once at the start (the default); False
            leaves it to the functions run, as :func:`mgtutor.launch` does.
        idle_timeout: seconds without a call after which the ranks are stopped, to free their
            memory (the next call starts new ones, without what they held, and says so); the
            default is ``MGTUTOR_IDLE_TIMEOUT``, else 600; None: never (:mod:`.lifetime`).

    Raises:
        ValueError, TypeError: bad arguments (nothing started).
        WorkerError, WorkerTimeout: a rank could not start or join the group (nothing left
            running).

    Example:
        >>> with mgtutor.Pool(world_size=2) as pool:
        ...     pool.push(x=3)
        ...     pool.run(lambda: x * (dist.get_rank() + 1)).results
        [3, 6]
    """

    #: The ranks outlive each call, keeping their namespace (False: each answers one call and
    #: exits, and the first fault stops them all, as a launch's do).
    keeps_ranks = True
    #: Who asks, in the error for an argument that is not a function.
    _caller = "Pool.run"
    _default_wording = Wording(owner="this pool", note=_POOL_NOTE)

    def __init__(
        self,
        world_size: int = 2,
        backend: str | None = None,
        *,
        start_timeout: float | None = 300.0,
        start_method: StartMethod | None = None,
        join_group: bool = True,
        idle_timeout: float | None | str = lifetime.FROM_ENVIRONMENT,
        _wording: Wording | None = None,
    ) -> None:
        if _processes.in_worker_bootstrap():
            raise RuntimeError(
                "mgtutor started ranks while a rank process was starting up. Put the code that "
                'launches under `if __name__ == "__main__":` in your script.'
            )
        backend = _arguments.backend_asked_for(backend)
        _arguments.check_arguments(world_size, backend, start_timeout, start_method)
        self.world_size = world_size
        self._backend_asked = self.backend = backend
        self.start_timeout = start_timeout
        self.start_method = start_method or _arguments.default_start_method()
        self.join_group = join_group
        self._wording = _wording or self._default_wording
        self._calls = 0
        self._supervisor: Supervisor | None = None
        self._store: TCPStore | None = None
        self.closed = False
        self.started_at = 0.0
        # Where relayed lines go instead of the cell, as sink(rank, stream, text): %%ddp's tabs.
        self.output_sink: Callable[[int, str, str], None] | None = None
        self._open(idle_timeout)

    # --- starting and stopping --------------------------------------------------------------

    def _open(self, idle_timeout: float | None | str) -> None:
        """Start the ranks now, and stop them after ``idle_timeout`` without a call."""
        lifetime.watch(self, idle_timeout)
        self._start()

    def _ready(self, supervisor: Supervisor) -> None:
        """Wait for every rank to start (and join the group), so a failure shows here."""
        supervisor.wait_ready(self.start_timeout)

    def _prepare_call(self) -> float:
        """Ranks ready for the next call (new ones after a fault); when the call's clock starts."""
        if not self.alive:
            self._restart_after_fault()
        return time.perf_counter()

    @lifetime.keeps_busy
    def _start(self) -> None:
        self._store = _processes.host_store(self.world_size)
        asked = self._backend_asked
        common = _processes.worker_environment(self.world_size, asked, self._store.port)
        ctx = _processes.context_for(self.start_method)
        supervisor = Supervisor(self._wording)
        self._supervisor = supervisor
        # Where each rank's doctor answers with its record of collectives (mgtutor.doctor).
        _cleanup.remove_stale_dump_folders()  # left by notebooks killed before they closed
        self._dump_dir = _cleanup.make_dump_folder()
        supervisor.dump_paths = {
            r: os.path.join(self._dump_dir, f"rank{r}.pkl") for r in range(self.world_size)
        }
        self.started_at = time.perf_counter()
        context = _send.context_now()
        # What the ranks already have: a call sends only what changed (cheaper round trips).
        self._context_key = _send.context_key()
        self._group_environ = self._group_environ_said = _send.group_variables(context.environ)
        self._sources_sent: set[str] = set()
        try:
            with _processes.main_not_reimported():
                for rank in range(self.world_size):
                    environ = {**common, DUMP_PATH_ENV: supervisor.dump_paths[rank]}
                    handle = _processes.start_rank(
                        ctx, rank, environ, context, join_group=self.join_group,
                        one_call=not self.keeps_ranks, backend=asked,
                    )
                    supervisor.add(handle)
            _open_pools.add(self)
            self._ready(supervisor)
            # The ranks' own choice where they made one at the start (backend=None: setup's).
            self.backend = _handle.agreed_backend(supervisor.handles) or asked
        except BaseException:
            self.stop_ranks()
            raise

    def stop_ranks(self) -> None:
        """End the ranks but keep the pool open: its next call starts new ones (idle timeout)."""
        if self._supervisor is not None:
            try:
                self._supervisor.close(Exit())
            finally:
                self._supervisor = None
                self._store = None
                shutil.rmtree(self._dump_dir, ignore_errors=True)

    @lifetime.keeps_busy
    def close(self) -> None:
        """End every rank (each leaves the process group first) and free the store's port.

        A rank that does not exit when asked is stopped after a few seconds, and the notebook
        says so. Calling close twice is harmless.
        """
        self.closed = True
        self.stop_ranks()

    def restart(self) -> None:
        """Stop every rank and start new ones (what the ranks held is lost)."""
        self.stop_ranks()
        self.closed = False
        self._start()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("running" if self.alive else "stopped")
        return (
            f"Pool(world_size={self.world_size}, backend={self.backend!r}, "
            f"start_method={self.start_method!r}, {state}, calls={self._calls})"
        )

    @property
    def alive(self) -> bool:
        """True while every rank runs (False after a fault stopped them, or after close)."""
        return self._supervisor is not None and self._supervisor.alive()

    # --- calls ------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        ranks: Sequence[int] | None = None,
        quiet: bool = False,
        **kwargs: Any,
    ) -> Run:
        """Run ``fn(*args, **kwargs)`` on every rank (or on ``ranks``) and wait for all.

        fn may be defined in a cell, a closure or a lambda. It runs with the rank's own global
        namespace: names it assigns with ``global`` stay for the next call and are never
        replaced by the notebook's; a name the rank does not have is the notebook's, as it is
        now (see the class's namespace rule). Variables that act only when a process group is
        made (``TORCH_DISTRIBUTED_DEBUG``, ``TORCH_FR_BUFFER_SIZE``, ``NCCL_*``, ``GLOO_*``)
        changed after the pool started are reported at the next call: ``restart`` applies them.

        Args:
            fn: the work of one rank.
            *args: positional arguments for fn (each rank gets its own copy).
            timeout: seconds fn may run once every rank started it; None is no limit. Past
                it, :class:`mgtutor.WorkerTimeout` shows each rank's stack and the pool's ranks
                are stopped (the next call starts new ones).
            ranks: run on these ranks only. A collective needs every rank of the group: if
                only some ranks enter one, they wait until ``timeout`` (then the pool restarts).
            quiet: show no progress bars (for calls made in a loop); what the ranks print and
                any error still come.
            **kwargs: keyword arguments for fn (``timeout``, ``ranks`` and ``quiet`` are taken
                by run).

        Returns:
            A :class:`mgtutor.Run` with one result per rank it ran on, in rank order.

        Raises:
            WorkerError: a rank raised (the pool is kept when the other ranks finished the
                call, and stopped when they did not), or died (the pool is stopped).
            WorkerTimeout: ``timeout`` passed; the pool's ranks were stopped.
            WorkerInterrupted: the cell was interrupted (a KeyboardInterrupt); fn is interrupted
                on every rank and the pool kept, or the ranks stopped when they could not be
                interrupted. It opens with where the ranks were, as a timeout does.
        """
        if not callable(fn):
            raise ArgumentError(f"{self._caller} needs a function to run on every rank, got {fn!r}")
        _arguments.check_seconds("timeout", timeout)
        targets = _arguments.check_ranks(ranks, self.world_size)
        payload, reusable = _payload.shared.dumps(fn, args, kwargs)
        return self._call(payload, targets, timeout, quiet, reusable)

    @lifetime.keeps_busy
    def _call(
        self,
        payload: bytes,
        targets: list[int],
        timeout: float | None,
        quiet: bool = False,
        reusable: bool = False,
    ) -> Run:
        """Send one pickled call to ``targets``, wait for their answers, build the Run."""
        if self.closed:
            raise PoolClosed("this pool is closed (by pool.close() or mgtutor.shutdown()): make "
                             "a new one with mgtutor.Pool(...), or call pool.restart()")
        started = self._prepare_call()
        supervisor = self._supervisor
        assert supervisor is not None
        handles = [supervisor.handles[r] for r in targets]
        self._calls += 1
        sources = _send.cell_sources(sent=self._sources_sent)
        self._sources_sent.update(sources)
        key = _send.context_key()
        context = _send.context_now() if key != self._context_key else None
        self._context_key = key
        if context is not None:
            self._say_group_variables_changed(context.environ)
        call = Call(
            self._calls,
            payload,
            sources,
            context,
            self.keeps_ranks,
            reusable and self.keeps_ranks,
        )
        # Once for every rank. Plain pickle (what Connection.recv reads too): a Call holds no
        # file descriptor or shared memory, which is all ForkingPickler adds, at twice the cost.
        pickled = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for h in handles:
            h.begin(call.call)
            h.output.sink = self.output_sink
            if not supervisor.send_pickled(h, pickled):
                h.failed_at = time.perf_counter()  # its pipe closed: the process has gone
        board = ProgressBoard(self.world_size, quiet)
        supervisor.run_call(
            call.call, handles, board, timeout, self.start_timeout, keep=self.keeps_ranks
        )
        _report.say_kept_names(handles, self._wording.push)
        return _handle.build_run(handles, self.world_size, started, time.perf_counter())

    def _say_group_variables_changed(self, environ: dict[str, str]) -> None:
        """Say once, at the call after the change, that a group variable does nothing yet."""
        now = _send.group_variables(environ)
        if not self.join_group or now == self._group_environ_said:
            return
        self._group_environ_said = now
        if now == self._group_environ:
            return
        print(
            f"mgtutor: changed since this pool's ranks made their process group: "
            f"{_send.changes(self._group_environ, now)}. These act only when a process group is "
            f"made, so the running ranks do not use the new values; "
            f"{self._wording.restart} starts new ranks that do (what the ranks hold is lost).",
            flush=True,
        )

    def _restart_after_fault(self) -> None:
        print(
            lifetime.pool_note(self, self._wording.kept)
            or "mgtutor: the pool's ranks had been stopped (see the last error); starting new "
            "ones. What the old ranks held (models, optimizers, names) is gone.",
            flush=True,
        )
        self.stop_ranks()
        self._start()

    def push(self, ranks: Sequence[int] | None = None, **values: Any) -> None:
        """Set names in each rank's namespace: ``pool.push(lr=0.1)``.

        Pushed names are the rank's own: later calls read them even where the notebook has a
        name of its own with another value (and say so).

        Args:
            ranks: only these ranks (default: all).
            **values: name=value pairs; each rank gets its own copy.
        """
        if not values:
            raise ArgumentError("push needs name=value pairs, e.g. pool.push(lr=0.1)")
        self.run(namespace.set_names, values, ranks=ranks)

    def pull(self, name: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Each rank's value of ``name`` (from its namespace), in rank order.

        Raises:
            WorkerError: a rank has no such name (the pool is kept).
        """
        return self.run(namespace.get_name, name, ranks=ranks).results
