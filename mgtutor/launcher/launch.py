"""Start DDP workers from a notebook cell and bring back what they printed and returned.

``launch(fn, world_size=2)`` does what torchrun does for a script: fn is pickled by value
(cloudpickle), so a function defined in a cell, a closure or a lambda reaches the ranks, which
plain ``torch.multiprocessing.spawn`` refuses; the rendezvous store is hosted on a fresh port of
127.0.0.1, so no crashed run leaves a port taken; ranks start by forkserver or spawn, never fork,
so a notebook that used CUDA can launch; the first failure, hang or interrupt stops them all.

A launch is a :class:`mgtutor.Pool` that runs one call and closes: the same code
(:mod:`._arguments`, :mod:`._processes`, :mod:`._send`, :mod:`mgtutor.rank.loop`,
:mod:`._relay`, :mod:`._supervise`, :mod:`._cleanup`) does the work; :class:`OneCall` changes
only when the ranks start and that they do not outlive the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mgtutor.launcher._arguments import START_METHODS, default_start_method
from mgtutor.launcher._handle import with_wall_time
from mgtutor.launcher._report import Wording
from mgtutor.launcher._supervise import Supervisor
from mgtutor.launcher.pool import Pool
from mgtutor.launcher.run import Run

__all__ = ["launch", "START_METHODS", "default_start_method"]


class OneCall(Pool):
    """A pool for one call, as :func:`launch` makes it.

    Nothing starts until the call has been checked and pickled; then the ranks start with the
    call already sent (nothing waits for them to be ready first), answer it and exit, a
    failing rank at once, as torchrun's workers do; the first fault stops them all; no idle
    timer watches them; their timings count from their start.
    """

    keeps_ranks = False
    _caller = "launch"
    _default_wording = Wording()

    def _open(self, idle_timeout: float | None | str) -> None:
        pass  # the ranks start with the call (_prepare_call)

    def _ready(self, supervisor: Supervisor) -> None:
        pass  # each rank reads the call once it has started: the two overlap

    def _prepare_call(self) -> float:
        self._start()
        return self.started_at


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str | None = None,
    timeout: float | None = None,
    start_timeout: float | None = 300.0,
    start_method: str | None = None,
    quiet: bool = False,
    **kwargs: Any,
) -> Run:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` worker processes, one per rank.

    Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT) and joins the process group with :func:`mgtutor.setup`
    or a plain ``dist.init_process_group("gloo")``. Lines the workers print appear in the cell as
    ``[rank 1] ...``. The notebook's own ``os.environ`` is left untouched.

    Args:
        fn: the work of one rank; may be defined in a notebook cell, a closure or a lambda.
        *args: positional arguments for fn (pickled; each rank gets its own copy).
        world_size: number of ranks.
        backend: "gloo" or "nccl" for every rank's :func:`mgtutor.setup`; None takes the
            notebook's MGTUTOR_BACKEND where it is set, else lets setup pick
            (NCCL with one GPU per rank, else gloo).
        timeout: seconds fn may run, counted from the moment every rank has started it; None
            (the default) means no limit. Past it every rank is stopped and
            :class:`mgtutor.WorkerTimeout` shows where each running rank was stuck.
        start_timeout: seconds the ranks may take to start (Python's start, imports,
            unpickling fn and its arguments) before fn runs; None means no limit. A node
            importing torch from a network file system may need more than the default.
        start_method: "forkserver" (the default on Linux: after the first launch a rank starts
            in a fraction of a second) or "spawn" (the default, and the only choice, on macOS:
            :func:`mgtutor.build.rank_start_method`). Both are safe after CUDA was used in
            the notebook; plain "fork" is not, and is refused.
        quiet: show no progress bars (for launches made in a loop); what the ranks print and
            any error still come.
        **kwargs: keyword arguments for fn. (Names world_size, backend, timeout,
            start_timeout, start_method, quiet and ranks are taken by launch itself; pass such
            arguments with functools.partial.)

    Returns:
        A :class:`mgtutor.Run`; ``run.results[r]`` is what rank r returned. Tensors on a GPU
        come back on the CPU (moved in the rank before sending), so the notebook's own process
        never initializes CUDA to read them.

    Raises:
        WorkerError: a rank raised, exited early or was killed; the other ranks were stopped.
        WorkerTimeout: ``timeout`` or ``start_timeout`` passed; every rank was stopped.
        WorkerInterrupted: the cell was interrupted (a KeyboardInterrupt); every rank was
            stopped, and the error says where each was and which one the others waited for.
        pickle.PicklingError: fn or an argument cannot be sent to a worker (nothing started).
        ValueError, TypeError: bad arguments (nothing started).
    """
    started = time.perf_counter()
    with OneCall(
        world_size,
        backend,
        start_timeout=start_timeout,
        start_method=start_method,
        join_group=False,
    ) as pool:
        run = pool.run(fn, *args, timeout=timeout, quiet=quiet, ranks=None, **kwargs)
    return with_wall_time(run, time.perf_counter() - started)
