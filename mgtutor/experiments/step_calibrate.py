"""Calibrate this machine's CPU ranks for the step-time model: what each part of a layer costs
(timed by :mod:`mgtutor.measure.cpu_timing`), gloo's links, a copy, the emulated wire.

:func:`calibrate` measures, on 2 gloo ranks busy at once, what a
:class:`~mgtutor.plan.machine.Hardware` needs to predict a step of CPU ranks: each matrix product
of the checked layers at its own shape (forward, input gradient, weight gradient, the attention
core's batched products; ``torch.mm``/``torch.bmm``), each memory-bound operation's seconds per
element forward and backward (LayerNorm, residual add, softmax with its causal mask, GeLU), gloo's
all-reduce and send/recv as latency + bytes / bandwidth (a line through the sizes a step sends,
fitted by relative error; each call timed after a stretch of compute, as a step meets it), a
copy of the gradients (DDP's bucket copies), and the emulated wire's latency per transfer
(:mod:`mgtutor.measure.emulated`). Compute is measured, not derived from a step: a layer's step
time is what the check predicts. Products and operations are timed in CPU seconds
(``time.process_time``), which other work on the machine does not stretch; a step's wall-clock
time is then predicted at the share of a core the rank gets, re-timed before each step.

:mod:`mgtutor.experiments.step_check` predicts with the result and measures the same ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from mgtutor.measure.cpu_timing import (
    elementwise_timers,
    gemm_shapes,
    gemm_timer,
    product_timers,
    reference_rate,
    seconds_per_call,
)
from mgtutor.plan.compute_time import Device
from mgtutor.plan.machine import DDP_BUCKET_BYTES, Hardware, Link
from mgtutor.plan.shape import Transformer

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECK_MODEL",
    "CLOCKS",
    "Clock",
    "at_rate",
    "calibrate",
    "elementwise_timers",
    "gemm_shapes",
    "needs_gloo_ranks",
    "reference_rate",
    "scaled",
    "seconds_per_call",
    "small_calls",
    "step_clock",
    "with_latencies",
]

#: The model the real-compute configurations train: 2 GPT layers
#: (:class:`~mgtutor.parallel.gpt_layer.GPTLayer`, no dropout), small enough that a step takes
#: tens of milliseconds on one core, with products and memory-bound operations both sizeable.
CHECK_MODEL = Transformer(layers=2, hidden=768, heads=12, seq_len=64, micro_batch=1)


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Latency (s) and bandwidth (bytes/s) of t = latency + bytes / bandwidth, least squares on
    the relative error (weights 1/t²), so that the small messages fit as well as the large."""
    w = [1 / y**2 for y in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sum(
        wi * (x - mx) ** 2 for wi, x in zip(w, sizes)
    )
    if slope <= 0:  # noise swamped the line: the largest message's rate, no latency
        return 0.0, sizes[-1] / seconds[-1]
    return max(my - slope * mx, 0.0), 1 / slope


def scaled(hardware: Hardware, factor: float, links: float = 1.0) -> Hardware:
    """``hardware`` computing ``factor`` times as fast (its products' rates, its operations'
    seconds per element, its copy) and its gloo links ``links`` times as fast (loopback: the
    cores move the bytes): the calibration at the share of a core the ranks get now."""
    d = hardware.device
    device = replace(
        d,
        gemm_rates={k: v * factor for k, v in d.gemm_rates.items()},
        elementwise={k: v / factor for k, v in d.elementwise.items()},
    )
    link = hardware.intra
    link = replace(
        link,
        bandwidth=link.bandwidth * links,
        p2p_bandwidth=(link.p2p_bandwidth or link.bandwidth) * links,
    )
    copy = hardware.copy * factor if hardware.copy else None
    return replace(hardware, device=device, intra=link, inter=link, copy=copy)


@dataclass(frozen=True)
class Clock:
    """A clock a real configuration's step and its re-timed rate are read on."""

    #: Seconds on this clock, called before and after what it times.
    timer: Callable[[], float]
    #: The key, in :func:`calibrate`'s extra, of the reference rate timed on the same clock.
    reference_key: str


#: Each clock by name (:func:`step_clock`'s answer).
CLOCKS: dict[str, Clock] = {
    "cpu": Clock(time.process_time, "reference"),
    "wall": Clock(time.perf_counter, "reference_wall"),
}


def step_clock(ranks: int) -> Literal["cpu", "wall"]:
    """The clock (a key of :data:`CLOCKS`) on which a real configuration of ``ranks`` ranks times
    its steps and the rate before each: one rank alone, CPU seconds, as the calibration times
    products and operations, at the rate one rank alone computes (the calibration timed both ranks
    at once, sharing caches and memory bandwidth); two ranks, wall-clock seconds, as their
    collectives wait for each other, at the share of a core the ranks got."""
    return "cpu" if ranks == 1 else "wall"


def at_rate(hardware: Hardware, extra: dict[str, Any], ranks: int, rate: float) -> Hardware:
    """``hardware`` (from :func:`calibrate`, with its ``extra``) at ``rate``, the reference
    product's FLOP/s that a real configuration of ``ranks`` ranks re-timed on
    :func:`step_clock`'s clock: compute moves by ``rate`` over the CPU-second reference (the
    calibration's rates are per CPU second); two ranks' gloo links by ``rate`` over the
    wall-clock reference (the links were timed in wall-clock seconds at the calibration's load).

    >>> cpu = Device("cpu", gemm_rates={(1, 1, 1): 1.0})
    >>> cpu = Hardware("cpu", cpu, Link(1.0), Link(1.0), 2, 10)
    >>> at_rate(cpu, {"reference": 2.0, "reference_wall": 1.0}, 1, 1.0).device.gemm_rates
    {(1, 1, 1): 0.5}
    """
    clock = step_clock(ranks)
    factor = rate / extra[CLOCKS[clock].reference_key]
    if clock == "cpu":  # the rate, the step and the calibration all per CPU second
        return scaled(hardware, factor)
    return scaled(hardware, rate / extra[CLOCKS["cpu"].reference_key], factor)


def _mean_seconds(
    fn: Callable[[], object], calls: int, work: Callable[[], object] | None = None
) -> float:
    """Mean seconds of ``calls`` calls of ``fn`` (every rank the same count), each after an
    untimed call of ``work``."""
    total = 0.0
    for _ in range(calls):
        if work is not None:
            work()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return total / calls


def _together_mean(
    call: Callable[..., object],
    calls: int,
    work: Callable[[], object] | None,
    per_call: int = 1,
) -> float:
    """:func:`_mean_seconds` of one of ``per_call`` collectives in ``call``, after a barrier and
    one untimed call (whatever ran before ended at a different moment on each rank)."""
    import torch.distributed as dist

    dist.barrier()
    call()
    return _mean_seconds(call, calls, work) / per_call


def needs_gloo_ranks(pool: object) -> None:
    """Raise ValueError unless ``pool`` has 2 gloo ranks: the check's tensors stay on the CPU,
    which NCCL (what :func:`mgtutor.setup` picks where each rank has a GPU) cannot reduce."""
    if getattr(pool, "world_size", 2) != 2 or getattr(pool, "backend", "gloo") != "gloo":
        raise ValueError(
            f"the step-time check runs on 2 gloo ranks, got {pool!r}: use "
            "mgtutor.Pool(2, backend='gloo') (CPU ranks, on a GPU machine too)"
        )


def _ping(t: torch.Tensor, rank: int) -> None:
    """Rank 0 sends ``t`` to rank 1, which sends it back: two sends."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def small_calls(model: Transformer) -> dict[str, Callable[[int], float]]:
    """Timers of the smallest collectives a step of ``model`` sends on 2 ranks (one
    micro-batch's activation): ``"all_reduce"`` (TP's) and ``"send"`` (the pipeline's), each
    taking a call count and returning one call's mean seconds, timed after a product."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(model.micro_batch * model.seq_len * model.hidden)
    h = model.hidden
    work, rank = gemm_timer((model.micro_batch * model.seq_len, h, 4 * h, 1)), dist.get_rank()
    return {
        "all_reduce": lambda calls: _together_mean(lambda: dist.all_reduce(t), calls, work),
        "send": lambda calls: _together_mean(lambda: _ping(t, rank), calls, work, per_call=2),
    }


def with_latencies(hardware: Hardware, model: Transformer, seconds: dict[str, float]) -> Hardware:
    """``hardware`` with its links' per-call latencies re-read from ``seconds`` (one call of a
    micro-batch's activation, as :func:`small_calls` times it) less its bytes over the link."""
    size = 4 * model.micro_batch * model.seq_len * model.hidden
    link = hardware.intra
    if "all_reduce" in seconds:
        link = replace(link, latency=max(seconds["all_reduce"] - size / link.bandwidth, 0.0))
    if "send" in seconds:
        p2p = link.p2p_bandwidth or link.bandwidth
        link = replace(link, p2p_latency=max(seconds["send"] - size / p2p, 0.0))
    return replace(hardware, intra=link, inter=link)


def _median_of(passes: list[Any]) -> Any:
    """The median over ``passes`` of each number in the same nested dicts and lists."""
    first = passes[0]
    if isinstance(first, dict):
        return {k: _median_of([p[k] for p in passes]) for k in first}
    if isinstance(first, list):
        return [_median_of([p[i] for p in passes]) for i in range(len(first))]
    return statistics.median(passes)


def _calibrate_rank(model: Transformer, sizes: list[int], window: float, calls: int) -> dict:
    """One rank's side of :func:`calibrate` (both ranks run the same, at once): ``model``'s
    products at tp 1 and 2, its operations."""
    import torch
    import torch.distributed as dist

    from mgtutor.measure.emulated import Wire
    from mgtutor.worker import setup

    setup()
    rank = dist.get_rank()
    out: dict[str, Any] = {"gemm": {}, "elementwise": {}}
    for shape in gemm_shapes(model):
        for key, fn in product_timers(shape).items():
            dist.barrier()
            flops = 2.0 * key[0] * key[1] * key[2] * shape[3]
            out["gemm"].setdefault(key, flops / seconds_per_call(fn, window, time.process_time))
    for kind, (op, elements) in elementwise_timers(model).items():
        dist.barrier()
        out["elementwise"][kind] = seconds_per_call(op, window, time.process_time) / elements
    out["reference"] = reference_rate(model, window, time.process_time)
    out["reference_wall"] = reference_rate(model, window)
    src = torch.randn(model.total)
    dst = torch.empty_like(src)
    dist.barrier()
    out["copy"] = (
        4 * model.total / seconds_per_call(lambda: dst.copy_(src), window, time.process_time)
    )
    work = gemm_timer((model.micro_batch * model.seq_len, model.hidden, 4 * model.hidden, 1))
    out["all_reduce"], out["send"] = [], []
    for size in sizes:
        t = torch.zeros(size // 4)
        out["all_reduce"].append(_together_mean(lambda t=t: dist.all_reduce(t), calls, work))
        out["send"].append(_together_mean(lambda t=t: _ping(t, rank), calls, work, per_call=2))
    wire = Wire(1e12)  # 1 TB/s: a transfer is its latency alone
    dist.barrier()
    out["wire"] = _mean_seconds(lambda: wire.send(0.0), calls)
    wire.close()
    return out


def calibrate(
    pool: Any,
    *,
    model: Transformer = CHECK_MODEL,
    sizes: tuple[int, ...] | None = None,
    window: float = 0.1,
    calls: int = 6,
    passes: int = 3,
) -> tuple[Hardware, dict[str, Any]]:
    """Measure this machine's 2 CPU ranks as a :class:`~mgtutor.plan.machine.Hardware`.

    Args:
        pool: a :class:`mgtutor.Pool` of 2 gloo ranks (``mgtutor.Pool(2, backend="gloo")``).
        model: the shape whose products (at tp 1 and 2) and operations are timed.
        sizes: message sizes (bytes) of the all-reduce and send/recv fits; by default a
            micro-batch's activation, 1 MiB and DDP's full bucket.
        window: seconds each rate is averaged over.
        calls: collectives timed per message size.
        passes: times every figure is measured, a pass at a time; each is the median of its
            passes. On the project's 2-core build machine, idle, with 0.03 s windows, 3 passes
            of a figure seconds apart disagreed by a median 3-21% per calibration (single
            figures by up to 107%); a median of 3 outvotes one slow pass, not two. The spread at
            the 0.1 s default was not measured per figure.

    Returns:
        The hardware (its device's ``gemm_rates`` and ``elementwise`` the slower rank's, per
        CPU second; gloo as its links, ``overlap=0``: gloo reduces on the cores that compute;
        ``copy``), and what else was measured: ``"reference"`` (:func:`reference_rate` at
        calibration, per CPU second; ``"reference_wall"`` per wall-clock second, at the load
        gloo's links were timed at) and ``"wire"`` (seconds of an emulated wire's transfer of
        no bytes).
    """
    from mgtutor.hardware import describe_hardware

    needs_gloo_ranks(pool)
    activation = 4 * model.micro_batch * model.seq_len * model.hidden
    sizes = sizes or (activation, 2**20, min(DDP_BUCKET_BYTES, 4 * model.total))
    if passes < 1:
        raise ValueError(f"passes={passes}: time each figure at least once (passes=1 or more)")
    runs = [pool.run(_calibrate_rank, model, list(sizes), window, calls, quiet=True).results
            for _ in range(passes)]  # fmt: skip
    results = [_median_of(list(each)) for each in zip(*runs)]  # per rank, over the passes
    gemm = {k: min(r["gemm"][k] for r in results) for k in results[0]["gemm"]}
    element = {k: max(r["elementwise"][k] for r in results) for k in results[0]["elementwise"]}
    reduce_s = [max(r["all_reduce"][i] for r in results) for i in range(len(sizes))]
    send_s = [max(r["send"][i] for r in results) for i in range(len(sizes))]
    link = Link(*_fit(list(sizes), reduce_s)[::-1], *_fit(list(sizes), send_s)[::-1])
    device = Device("this machine's CPU rank (1 thread)", gemm_rates=gemm, elementwise=element)
    hardware = Hardware(
        name="this machine's CPU ranks, gloo over loopback (1 thread per rank)",
        device=device,
        intra=link,
        inter=link,
        gpus_per_node=2,
        memory=describe_hardware().memory_bytes // 2,
        overlap=0.0,
        copy=min(r["copy"] for r in results),
        source=f"calibrate(): {len(gemm)} products and {len(element)} operations of {model}, "
        f"both ranks busy; gloo at {list(sizes)} bytes, relative least squares; a copy",
    )
    extra = {
        "reference": min(r["reference"] for r in results),
        "reference_wall": min(r["reference_wall"] for r in results),
        "wire": max(r["wire"] for r in results),
    }
    return hardware, extra
