"""Per-step phase timing inside a rank: data, forward, backward, optimizer step, all-reduce.

Blocks timed with :func:`step` and :func:`phase` come back as ``run.timings``
(:func:`mgtutor.plot_timeline`, :func:`mgtutor.plot_step_times`). Times are
``time.perf_counter()`` seconds, the machine's monotonic clock, so all ranks share one axis.
On a GPU each boundary records a CUDA event, read only when the records are collected: timing
adds no synchronization, and a phase is the GPU time of the work queued in it. ``sync=True``
synchronizes at each boundary instead: exact wall time, but the CPU no longer runs ahead of the
GPU, which changes what is measured (and hides DDP's overlap of all-reduce with backward).

Under DDP the gradient all-reduce runs inside ``loss.backward()``: to see DDP's own all-reduces
as "allreduce" records, run the steps inside :func:`mgtutor.record_trace`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from torch.nn.parallel import DistributedDataParallel

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

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        # Record on this device's stream: Event.record() without one uses the *current*
        # device's stream, which is another GPU's when the current device was never set.
        self._stream = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        self._anchor_time = time.perf_counter()
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(self._stream)

    def mark(self) -> torch.cuda.Event:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def resolve(self, mark: torch.cuda.Event) -> float:
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

    def __init__(
        self, device: torch.device | str | None = None, *, sync: bool = False, enabled: bool = True
    ) -> None:
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

    def watch_allreduce(self, ddp_model: DistributedDataParallel) -> None:
        """Replace DDP's all-reduce with a Python hook that times itself as "allreduce" records.

        The hook does what DDP's built-in all-reduce does (divide the bucket by the world size,
        all-reduce it), so it times its own all-reduce (Python, the GIL, a future's callback),
        not DDP's: for that, :func:`mgtutor.record_trace`.

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

            def finished(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
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

    def watch_gradients(self, module: torch.nn.Module) -> None:
        """Record the moment autograd writes each parameter's ``.grad``, as a "gradient" record.

        Each record is an instant (start equals end) with ``nbytes`` the gradient's size; with
        :meth:`watch_allreduce` they tell whether an all-reduce began before the last gradient.

        Args:
            module: the model whose parameters to watch (a DDP model or the module it wraps).
        """
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        now = self._now()
        nbytes = parameter.numel() * parameter.element_size()
        self._pending.append(("gradient", self._step, now, now, None, nbytes))

    @property
    def steps_done(self) -> int:
        """How many steps this timer has timed: the next step's number."""
        return self._step

    def add(self, record: PhaseRecord) -> None:
        """Keep a record measured elsewhere (record_trace's), its times in perf_counter seconds."""
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


def phase(name: str) -> AbstractContextManager[None]:
    """Time a block as phase ``name`` on the default timer: ``with mgtutor.phase("forward"):``."""
    return timer().phase(name)


def step(samples: int | None = None) -> AbstractContextManager[None]:
    """Time a block as one step on the default timer: ``with mgtutor.step(samples=32):``."""
    return timer().step(samples)


def collect_records(clear: bool = False) -> list[PhaseRecord]:
    """Every record of every timer made in this process (the launch sends them to the parent).

    ``clear`` forgets them once collected, so that a pool's next call starts with none.
    """
    out: list[PhaseRecord] = []
    for t in _registry:
        out.extend(t.records())
        if clear:
            t._pending.clear()
            t._added.clear()
    return out
