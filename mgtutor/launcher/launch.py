"""Start DDP workers from a notebook cell and bring back what they printed and returned.

``launch(fn, world_size=2)`` does what torchrun does for a script, from inside a notebook:

1. It checks its arguments and pickles ``fn`` *by value* with cloudpickle, so a function defined
   in a cell, a closure or a lambda reaches the workers (plain ``torch.multiprocessing.spawn``
   pickles functions by name and fails on cell-defined ones).
2. It hosts the rendezvous store itself on a fresh port of 127.0.0.1, like torchrun's agent, so
   no fixed port can be left taken by a crashed run and nothing listens beyond this machine.
3. It starts ``world_size`` processes (forkserver or spawn, never fork, so a notebook that
   already used CUDA can launch), each with torchrun's environment contract.
4. While they run, it relays every line they print into the cell, prefixed with the rank, and
   shows their progress; it stops all of them as soon as one fails, hangs past ``timeout`` or
   the cell is interrupted, and leaves no process behind.

A launch is a :class:`mgtutor.Pool` that runs one call and closes
(``with OneCall(...) as pool: pool.run(fn, ...)``): the same code checks the arguments
(:mod:`._arguments`), starts the ranks (:mod:`._processes`), sends fn (:mod:`._send`), runs it
in each rank (:mod:`mgtutor.rank.loop`), relays output (:mod:`._relay`), watches for faults
(:mod:`._supervise`) and cleans up (:mod:`._cleanup`). :class:`OneCall` changes only when the
ranks start and that they do not outlive the call.
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
    MASTER_ADDR=127.0.0.1, MASTER_PORT) and joins the process
    group with :func:`mgtutor.setup` or with a plain ``dist.init_process_group("gloo")``: the
    notebook's process hosts the rendezvous store on a fresh port of 127.0.0.1, as torchrun's
    agent does for its workers (``TORCHELASTIC_USE_AGENT_STORE``). Lines the workers print
    appear in the cell as ``[rank 1] ...``. The notebook's own ``os.environ`` is left untouched.

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
            unpickling fn and its arguments) before fn runs; None means no limit. The default
            of 5 minutes is generous for a laptop; a cluster node importing torch from a
            network file system may need more.
        start_method: how the rank processes start. "forkserver" (the default on Linux): a
            server process that has imported torch once, and never touched CUDA, forks each
            rank; after the first launch in a session a rank starts in a fraction of a second.
            "spawn" (the default, and the only choice, on macOS, where forking after torch
            can abort: :func:`mgtutor.build.rank_start_method`): every rank is a fresh
            interpreter that imports torch itself (about a second or more per launch). Both
            are safe after CUDA was used in the notebook; plain "fork" is not, and is refused.
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

    Example:
        >>> def work(scale):
        ...     mgtutor.setup()
        ...     t = torch.ones(1) * (dist.get_rank() + 1) * scale
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> mgtutor.launch(work, 10, world_size=2).results
        [30.0, 30.0]
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
