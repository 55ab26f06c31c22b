"""Run a function once on every rank, from a notebook cell: :func:`launch`.

``fn`` is pickled by value (cloudpickle), so a function defined in a cell, a closure or a lambda
reaches the ranks, which ``torch.multiprocessing.spawn`` refuses. A launch is a
:class:`mgtutor.Pool` that runs one call and closes, so the two share all their machinery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mgtutor.launcher._arguments import START_METHODS, default_start_method
from mgtutor.launcher._handle import with_wall_time
from mgtutor.launcher._report import Wording
from mgtutor.launcher._supervise import Supervisor
from mgtutor.launcher.pool import Pool
from mgtutor.launcher.run import Run

if TYPE_CHECKING:
    from mgtutor.build import StartMethod

__all__ = ["launch", "START_METHODS", "default_start_method"]


class OneCall(Pool):
    """A pool for one call, as :func:`launch` makes it.

    The ranks start with the call already sent, answer it and exit (a failing rank at once, as
    torchrun's workers do); no idle timer watches them; their timings count from their start.
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
    start_method: StartMethod | None = None,
    quiet: bool = False,
    **kwargs: Any,
) -> Run:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` new processes, one per rank.

    Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT); fn joins the process group itself, with
    :func:`mgtutor.setup` or ``dist.init_process_group``. What a rank prints shows in the cell as
    ``[rank 1] ...``. The notebook's own ``os.environ`` is left untouched.

    Args:
        fn: one rank's work; it may be defined in a cell, a closure or a lambda.
        *args: fn's positional arguments (pickled: each rank gets its own copy).
        world_size: number of ranks.
        backend: "gloo" or "nccl" for every rank's :func:`mgtutor.setup`; None: the notebook's
            MGTUTOR_BACKEND where set, else setup's choice (NCCL with one GPU per rank, else gloo).
        timeout: seconds fn may run, counted once every rank has started it; None: no limit.
        start_timeout: seconds the ranks may take to start (Python, imports, unpickling) before
            fn runs; None: no limit. Importing torch from a network file system may need more.
        start_method: "forkserver" (Linux's default, fast after the first launch) or "spawn"
            (the only one on macOS). "fork" is refused: unsafe once the notebook has used CUDA.
        quiet: no progress bars (for launches in a loop); output and errors still show.
        **kwargs: fn's keyword arguments. Names launch takes itself (world_size, backend,
            timeout, start_timeout, start_method, quiet, ranks) go through functools.partial.

    Returns:
        A :class:`mgtutor.Run`; ``run.results[r]`` is what rank r returned. Tensors on a GPU
        come back on the CPU (moved in the rank), so the notebook never initializes CUDA.

    Raises:
        WorkerError: a rank raised, exited early or was killed; the others were stopped.
        WorkerTimeout: ``timeout`` or ``start_timeout`` passed; every rank was stopped.
        WorkerInterrupted: the cell was interrupted; every rank was stopped.
        pickle.PicklingError: fn or an argument cannot be sent to a rank (nothing started).
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
