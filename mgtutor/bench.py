"""All-reduce bandwidth on this machine's backend, against its memory-copy bandwidth.

Run it from a notebook (:func:`measure_allreduce`, then :func:`plot_bandwidth`) or a shell::

    python -m mgtutor.bench --world-size 2 --max-size 64M --plot allreduce.png

For each message size it times ``dist.all_reduce`` on every rank and reports nccl-tests' two
bandwidths:

* **algorithm bandwidth** ``algbw = S / t``: message bytes over the time of one all-reduce;
* **bus bandwidth** ``busbw = algbw * 2(n-1)/n``: what each rank's link carried, since a ring
  all-reduce sends ``2(n-1)/n * S`` bytes from every rank. busbw can be compared across world
  sizes and with the hardware's link speed; algbw cannot.

The time of a size is the slowest rank's mean over the timed iterations (after warm-up; nccl-tests
by default averages its ranks' times instead, its ``-a`` option); on GPUs
the iterations are bracketed by ``torch.cuda.synchronize()``, since NCCL's all-reduce only
queues work on the GPU and returns. As a reference ceiling the same run measures a plain memory
copy of the largest message in one process (``dst.copy_(src)``), counted as copied bytes per
second: each byte is read once and written once, so the memory traffic is twice that figure. On
one CPU machine, gloo's loopback all-reduce cannot beat it.

Everything runs in the ranks, the copy included (rank 0 makes it, on its own device): the
calling process never touches CUDA, so a notebook that runs the benchmark keeps no GPU memory
and can still use launchers that fork.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from matplotlib.figure import Figure

__all__ = ["BandwidthPoint", "BandwidthResult", "measure_allreduce", "plot_bandwidth"]

DEFAULT_SIZES = tuple(1024 * 4**i for i in range(9))  # 1 KiB ... 64 MiB
_TARGET_BYTES_PER_SIZE = 256 * 1024 * 1024  # enough repetitions to time small sizes well


@dataclass(frozen=True)
class BandwidthPoint:
    """One message size's measurement (bytes, seconds, bytes per second).

    ``seconds`` (and the bandwidths) come from a loop run without torch's profiler. With
    ``measure_allreduce(..., profile=True)`` the same loop runs once more, as a separate repeat,
    inside it (:func:`mgtutor.record_trace`): ``under_profiler`` is that repeat's time per call
    on the loop's own clock, and ``profiled`` the same calls as the profiler timed them (the
    process group's own events); each the slowest rank's mean, in seconds; otherwise None.
    ``iterations`` is the plain loop's count of calls and ``loop_seconds`` its whole length on
    a clock read outside the loop's own (``time.monotonic`` around it, its barrier included),
    the slowest rank's: ``seconds * iterations`` must lie within it.
    """

    size: int
    seconds: float
    algbw: float
    busbw: float
    profiled: float | None = None
    under_profiler: float | None = None
    iterations: int | None = None
    loop_seconds: float | None = None


@dataclass(frozen=True)
class BandwidthResult:
    """A whole sweep: the points, the setting, and the memory-copy reference."""

    points: list[BandwidthPoint]
    world_size: int
    backend: str
    device: str
    copy_bandwidth: float
    copy_size: int

    def table(self) -> str:
        """The sweep as a Markdown table (sizes in KiB/MiB, bandwidths in GB/s)."""
        lines = [
            f"all-reduce, {self.backend} on {self.device}, world size {self.world_size}",
            "| size | time (us) | algbw (GB/s) | busbw (GB/s) |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for p in self.points:
            lines.append(
                f"| {_size_label(p.size)} | {p.seconds * 1e6:.1f} | {p.algbw / 1e9:.3f} | "
                f"{p.busbw / 1e9:.3f} |"
            )
        lines.append(
            f"memory copy of {_size_label(self.copy_size)} in one process: "
            f"{self.copy_bandwidth / 1e9:.2f} GB/s copied (reads + writes: twice that)"
        )
        return "\n".join(lines)


def _size_label(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def _iterations(size: int) -> int:
    return max(5, min(200, _TARGET_BYTES_PER_SIZE // size))


def _barrier(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        # NCCL's barrier is an all-reduce of one number on some GPU; name this rank's, or torch
        # guesses it (and warns) when init_process_group was not given a device_id.
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _sweep(
    sizes: list[int], warmup: int, profile: bool = False, profile_first: bool = False
) -> dict[str, Any]:
    """One rank's side of :func:`measure_allreduce`: time every size, then (rank 0) the copy."""
    import contextlib

    import torch
    import torch.distributed as dist

    import mgtutor
    from mgtutor.measure.timing import StepTimer

    device = mgtutor.setup()
    world = dist.get_world_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def per_call(tensor: torch.Tensor, iterations: int, profiled: bool) -> list[float]:
        # One timed loop: seconds per call on perf_counter and, inside the profiler, per call
        # as the process group's events timed the same calls.
        # record_trace starts with a barrier; without it, so does the timed loop.
        recording = mgtutor.record_trace(StepTimer("cpu")) if profiled else None
        with recording or contextlib.nullcontext() as trace:
            if trace is None:
                _barrier(device)
            sync()
            start = time.perf_counter()
            for _ in range(iterations):
                dist.all_reduce(tensor)
            sync()
            elapsed = time.perf_counter() - start
        if trace is None:
            return [elapsed / iterations]
        spans = [c.duration for c in trace.collectives("all_reduce")][-iterations:]
        return [elapsed / iterations, sum(spans) / len(spans)]

    points = []
    for size in sizes:
        # Zeros stay zeros however often they are summed. Ones would double at every all-reduce
        # on 2 ranks and overflow float32 to infinity after 128, so sums of infinities were timed.
        tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        iterations = _iterations(size)
        # The plain loop gives the point; with profile, a separate repeat inside the profiler,
        # after it or (profile_first) before it.
        order = ((True, False) if profile_first else (False, True)) if profile else (False,)
        repeats, outer = {}, 0.0
        for profiled in order:
            if not profiled:
                _barrier(device)  # a rank still leaving the profiler holds up this one, not here
            begun = time.monotonic()  # a second clock around the plain loop, read outside it
            repeats[profiled] = per_call(tensor, iterations, profiled)
            if not profiled:
                sync()  # on GPUs: a loop that forgot its own wait is still timed in full here
                outer = time.monotonic() - begun
        means = repeats[False] + [outer] + repeats.get(True, [])
        # On the rank's device: NCCL reduces CUDA tensors only.
        mean = torch.tensor(means, dtype=torch.float64, device=device)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        seconds, loop_seconds, *profiled_loop = mean.tolist()
        algbw = size / seconds
        under, spans = profiled_loop or (None, None)
        busbw = algbw * 2 * (world - 1) / world
        points.append(
            BandwidthPoint(size, seconds, algbw, busbw, spans, under, iterations, loop_seconds)
        )

    copy_bandwidth = _copy_bandwidth(sizes[-1], device) if dist.get_rank() == 0 else None
    # The other ranks wait here, idle, instead of exiting while rank 0 copies: their exit
    # would compete with the copy for the CPU and the memory bus.
    _barrier(device)
    return {
        "points": points,
        "world_size": world,
        "backend": dist.get_backend(),
        "device": str(device),
        "copy_bandwidth": copy_bandwidth,
    }


def _copy_bandwidth(size: int, device: torch.device, repeats: int = 10) -> float:
    """Bytes per second of the fastest of ``repeats`` copies of ``size`` bytes on ``device``."""
    import torch

    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch allocates the pages; do not time it
    best = float("inf")
    if device.type == "cuda":
        # CUDA events time the copy on the GPU itself. A host timer around synchronize() would
        # add microseconds of launch and wake-up latency to a copy that lasts tens of them.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            for _ in range(repeats):
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)  # given in milliseconds
        return size / best

    from mgtutor.hardware import usable_cores

    # setup() gave this rank its share of the cores; the ceiling is a copy that may use all of
    # them, while the other ranks wait in a barrier.
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        for _ in range(repeats):
            start_s = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start_s)
    finally:
        torch.set_num_threads(threads)
    return size / best


def measure_allreduce(
    world_size: int = 2,
    sizes: list[int] | tuple[int, ...] = DEFAULT_SIZES,
    *,
    backend: str | None = None,
    warmup: int = 3,
    profile: bool = False,
    profile_first: bool = False,
) -> BandwidthResult:
    """Time all-reduce over ``sizes`` on ``world_size`` ranks, and a memory copy as reference.

    The copy of the largest size is made by rank 0 on its own device (a GPU with NCCL), so this
    process never initializes CUDA.

    Args:
        world_size: number of ranks to launch.
        sizes: message sizes in bytes (multiples of 4: the messages are float32 tensors).
        backend: "gloo" or "nccl"; by default what :func:`mgtutor.setup` picks.
        warmup: untimed all-reduces per size before timing.
        profile: also run each size's loop once more inside torch's profiler, a separate
            repeat (each point's ``under_profiler``, and ``profiled``: a second clock on the
            same calls, to check the first against); ``seconds`` stays the plain loop's.
        profile_first: run that profiled repeat before the plain loop, not after it.

    Returns:
        The :class:`BandwidthResult`.

    Raises:
        ValueError: a size that is not a positive multiple of 4, or no sizes.

    Example:
        >>> result = measure_allreduce(2, [2**10, 2**20])
        >>> print(result.table())
    """
    import mgtutor

    sizes = sorted(int(s) for s in sizes)
    if not sizes or any(s <= 0 or s % 4 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes, got {sizes}")
    run = mgtutor.launch(
        _sweep, sizes, warmup, profile, profile_first, world_size=world_size, backend=backend
    )
    sweep = run.results[0]
    return BandwidthResult(
        points=sweep["points"],
        world_size=sweep["world_size"],
        backend=sweep["backend"],
        device=sweep["device"].split(":")[0],
        copy_bandwidth=sweep["copy_bandwidth"],
        copy_size=sizes[-1],
    )


def plot_bandwidth(result: BandwidthResult) -> Figure:
    """algbw and busbw against message size (log-log), with the memory-copy line for reference."""
    from mgtutor.measure.figure import new_figure

    fig = new_figure(7, 4)  # drawn once in a notebook however it is shown
    ax = fig.add_subplot()
    sizes = [p.size for p in result.points]
    ax.plot(sizes, [p.algbw / 1e9 for p in result.points], "o-", label="algorithm bandwidth S/t")
    ax.plot(
        sizes,
        [p.busbw / 1e9 for p in result.points],
        "s-",
        label=f"bus bandwidth S/t x 2(n-1)/n, n={result.world_size}",
    )
    ax.axhline(
        result.copy_bandwidth / 1e9,
        color="grey",
        linestyle="--",
        label=f"memory copy of {_size_label(result.copy_size)}, one process",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sizes[:: max(1, len(sizes) // 5)]
    ax.set_xticks(ticks, [_size_label(s) for s in ticks])
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"all-reduce bandwidth: {result.backend} on {result.device}, {result.world_size} ranks",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    return fig


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m mgtutor.bench --help``."""
    parser = argparse.ArgumentParser(
        prog="python -m mgtutor.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to launch (default 2)")
    parser.add_argument("--min-size", type=_parse_size, default="1K", help="smallest message (1K)")
    parser.add_argument("--max-size", type=_parse_size, default="64M", help="largest message (64M)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--plot", metavar="FILE", help="also save the plot to FILE (.png, .svg)")
    args = parser.parse_args(argv)
    if args.min_size > args.max_size:
        parser.error(f"--min-size {args.min_size} is larger than --max-size {args.max_size}")
    sizes = [s for s in DEFAULT_SIZES if args.min_size <= s <= args.max_size] or [args.max_size]
    result = measure_allreduce(args.world_size, sizes, backend=args.backend)
    print(result.table())
    if args.plot:
        plot_bandwidth(result).savefig(args.plot)
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
