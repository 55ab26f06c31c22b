"""Per-step phase timing inside a worker: data, forward, backward, optimizer step, all-reduce.

Use it in the training loop, then look at the records in ``run.timings`` or with
:func:`mgtutor.plot_timeline` and :func:`mgtutor.plot_step_times`::

    for batch in range(steps):
        with mgtutor.step(samples=len(x)):
            with mgtutor.phase("data"):
                x, y = next(it)
            with mgtutor.phase("forward"):
                loss = loss_fn(model(x), y)
            with mgtutor.phase("backward"):
                loss.backward()
            with mgtutor.phase("optimizer"):
                opt.step()

How times are taken:

* CPU ranks: ``time.perf_counter()`` at each boundary. It is the machine's monotonic clock,
  shared by every process on it, so the ranks' bars line up on one time axis.
* GPU ranks (default, ``sync=False``): a CUDA event is recorded on the current stream at each
  boundary and read only when the records are collected, so timing adds no synchronization.
  A phase then lasts from when the GPU reached its start to when it reached its end: the GPU
  time of the work queued in it. Events are placed on the wall-clock axis through one event
  recorded right after a ``torch.cuda.synchronize()`` when the timer was made.
* GPU ranks with ``sync=True``: ``torch.cuda.synchronize()`` at each boundary, then
  ``perf_counter()``. Exact wall time per phase, but it stops the CPU from running ahead of the
  GPU, which changes what is measured (and hides DDP's overlap of all-reduce with backward).

The gradient all-reduce runs inside ``loss.backward()`` under DDP, overlapped with it. To see
DDP's own all-reduces as bars, run the steps inside :func:`mgtutor.record_trace`: torch's
profiler records each one as the process group ran it and adds it here as an "allreduce" record.
:meth:`StepTimer.watch_allreduce` is another view: it *replaces* DDP's built-in C++ all-reduce
with a Python communication hook that does the same arithmetic and times itself, so it times the
hook, not DDP's own all-reduce. :meth:`StepTimer.watch_gradients` records the moment each
parameter's gradient was written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["PhaseRecord", "StepTimer", "timer", "phase", "step"]

STEP = "step"


@dataclass(frozen=True)
class PhaseRecord:
    """One timed interval on one rank.

    Attributes:
        name: the phase ("forward", ...); whole steps are recorded under the name "step".
        step: index of the step it belongs to (0-based).
        start: start time in seconds on the machine's monotonic clock (``perf_counter``).
        end: end time on the same clock.
        samples: for a "step" record, how many samples it processed, if told.
        nbytes: for an "allreduce" record, the size of the bucket reduced; for a "gradient"
            record (an instant: start equals end), the size of the gradient.
    """

    name: str
    step: int
    start: float
    end: float
    samples: int | None = None
    nbytes: int | None = None

    @property
    def duration(self) -> float:
        """Length of the interval in seconds."""
        return self.end - self.start


class _CudaClock:
    """Timestamps from CUDA events, placed on the perf_counter axis through one anchor."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        # Record on this device's stream: Event.record() without one uses the *current*
        # device's stream, which is another GPU's when the current device was never set.
        self._stream = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        self._anchor_time = time.perf_counter()
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(self._stream)

    def mark(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def resolve(self, mark: Any) -> float:
        return self._anchor_time + self._anchor.elapsed_time(mark) / 1000.0


class StepTimer:
    """Records named phases per training step on this rank.

    Args:
        device: the rank's device; CUDA devices are timed with CUDA events (see module doc).
            By default the device :func:`mgtutor.setup` picked.
        sync: on CUDA, synchronize at each boundary instead of using events.
        enabled: when False, ``phase`` and ``step`` do nothing (to measure the timer's cost).

    Example:
        >>> t = StepTimer("cpu")
        >>> with t.step(samples=32):
        ...     with t.phase("forward"):
        ...         pass
        >>> [r.name for r in t.records()]
        ['forward', 'step']
    """

    def __init__(self, device: Any = None, *, sync: bool = False, enabled: bool = True) -> None:
        if device is None:
            from mgtutor.worker import current_device

            device = current_device()
        self.device = str(device)
        self.sync = sync
        self.enabled = enabled
        self._cuda = self.device.startswith("cuda")
        self._clock = _CudaClock(self.device) if self._cuda and not sync else None
        self._pending: list[tuple[str, int, Any, Any, int | None, int | None]] = []
        self._added: list[PhaseRecord] = []
        self._step = 0
        _registry.append(self)

    def _now(self) -> Any:
        if self._clock is not None:
            return self._clock.mark()
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` of the current step."""
        with self._span(name):
            yield

    @contextmanager
    def step(self, samples: int | None = None) -> Iterator[None]:
        """Time the block as one whole step; the steps are numbered 0, 1, 2, ...

        Args:
            samples: how many samples this rank processed in the step; needed for throughput
                (:func:`mgtutor.plot_scaling`).
        """
        try:
            with self._span(STEP, samples):
                yield
        finally:
            if self.enabled:
                self._step += 1

    @contextmanager
    def _span(self, name: str, samples: int | None = None) -> Iterator[None]:
        # One record per block, kept even when the block raises (the step it failed in shows).
        if not self.enabled:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            self._pending.append((name, self._step, start, self._now(), samples, None))

    def watch_allreduce(self, ddp_model: Any) -> None:
        """Replace DDP's all-reduce with a Python hook that times itself as "allreduce" records.

        Registers a communication hook that does what DDP's built-in C++ all-reduce does (divide
        the bucket by the world size, then all-reduce it) and notes when each all-reduce was
        launched and when it completed. On CPU the completion time is taken when gloo finishes;
        on CUDA it is a CUDA event recorded once the result is ready on the stream. What it
        times is the hook's all-reduce (Python, the GIL, a future's callback), not DDP's own:
        for that, :func:`mgtutor.record_trace`.

        Args:
            ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model without a hook yet.
        """
        import torch.distributed as dist

        # No annotations here: DDP rejects a hook whose annotations are not its own types.
        def hook(state, bucket):
            buffer = bucket.buffer()
            world = dist.get_world_size()
            step_index = self._step
            start = self._now()
            buffer.div_(world)
            future = dist.all_reduce(buffer, async_op=True).get_future()

            def finished(done: Any) -> Any:
                self._pending.append(
                    (
                        "allreduce",
                        step_index,
                        start,
                        self._now(),
                        None,
                        buffer.numel() * buffer.element_size(),
                    )
                )
                return done.value()[0]

            return future.then(finished)

        ddp_model.register_comm_hook(state=None, hook=hook)

    def watch_gradients(self, module: Any) -> None:
        """Record the moment autograd finishes each parameter's gradient, as a "gradient" record.

        A post-accumulate-grad hook on every parameter of ``module`` notes when that parameter's
        ``.grad`` was written in the current step: a record whose start and end are that moment,
        with ``nbytes`` the gradient's size. With :meth:`watch_allreduce` the records tell
        whether an all-reduce was launched before the step's last gradient existed.

        Args:
            module: the model whose parameters to watch (a DDP model or the module it wraps).
        """
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, parameter: Any) -> None:
        now = self._now()
        nbytes = parameter.numel() * parameter.element_size()
        self._pending.append(("gradient", self._step, now, now, None, nbytes))

    @property
    def steps_done(self) -> int:
        """How many steps this timer has timed: the next step's number."""
        return self._step

    def add(self, record: PhaseRecord) -> None:
        """Keep a record measured elsewhere (:func:`mgtutor.record_trace`'s collectives).

        Args:
            record: times on this timer's axis (``perf_counter`` seconds).
        """
        self._added.append(record)

    def records(self) -> list[PhaseRecord]:
        """All intervals recorded so far: timed ones in the order they ended, then added ones."""
        if self._clock is not None:
            import torch

            torch.cuda.synchronize(self.device)
            resolve = self._clock.resolve
        else:

            def resolve(mark: Any) -> float:
                return float(mark)

        timed = [
            PhaseRecord(name, step_index, resolve(start), resolve(end), samples, nbytes)
            for name, step_index, start, end, samples, nbytes in self._pending
        ]
        return timed + self._added


_registry: list[StepTimer] = []
_default: list[StepTimer] = []


def timer() -> StepTimer:
    """This rank's default timer, made on first use for the device :func:`mgtutor.setup` chose."""
    if not _default:
        _default.append(StepTimer())
    return _default[0]


def phase(name: str) -> Any:
    """Time a block as phase ``name`` on the default timer: ``with mgtutor.phase("forward"):``."""
    return timer().phase(name)


def step(samples: int | None = None) -> Any:
    """Time a block as one step on the default timer: ``with mgtutor.step(samples=32):``."""
    return timer().step(samples)


def collect_records(clear: bool = False) -> list[PhaseRecord]:
    """Every record of every timer made in this process (the launch sends them to the parent).

    Args:
        clear: forget the records once collected, so a pool's next call starts with none.
    """
    out: list[PhaseRecord] = []
    for t in _registry:
        out.extend(t.records())
        if clear:
            t._pending.clear()
            t._added.clear()
    return out
