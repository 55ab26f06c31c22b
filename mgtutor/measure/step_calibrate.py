"""Calibrate this machine's CPU ranks for the step-time model: achieved FLOP/s and gloo's links.

:func:`calibrate` measures what :class:`~mgtutor.plan.step_time.Hardware` needs on CPU ranks
(gloo). The FLOP/s is an achieved rate, as the time model asks: the counted FLOPs of one training
step (forward and backward) of one :class:`~mgtutor.parallel.gpt_layer.GPTLayer` of the checked
model's shape, divided by its measured time (the idea of MFU, model FLOPs utilization: Chowdhery
et al., "PaLM", arXiv:2204.02311, appendix B). A step's matrix products alone run faster: the rest
of a step (norms, softmax, autograd's bookkeeping, dispatch) is time without counted FLOPs, so a
bare product's rate predicts every step too fast; it is measured too, to show the gap. gloo's
all-reduce and send/recv are latency + bytes / bandwidth, a line through the message sizes a step
sends, fitted by relative error so that the small messages (TP's activations, the pipeline's
sends) are fitted as well as the large ones (DDP's buckets). Each call is timed after a stretch
of compute on every rank, as a step meets it: the ranks then arrive apart and the later one sets
when the call ends (a synchronisation cost per collective that back-to-back calls, the way
nccl-tests and gloo's benchmark time them, never see).

:mod:`mgtutor.measure.step_check` predicts with the result and measures the same ranks.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from mgtutor.plan.planner import Transformer
from mgtutor.plan.step_time import DDP_BUCKET_BYTES, Hardware, Link, compute_flops

__all__ = [
    "CHECK_MODEL",
    "bare_matmul",
    "calibrate",
    "layer_step",
    "needs_gloo_ranks",
    "seconds_per_call",
    "small_calls",
    "with_latencies",
]

#: The model every configuration of the check trains: 2 GPT layers (:class:`~mgtutor.parallel.
#: gpt_layer.GPTLayer`, no dropout), small enough that a step takes a tenth of a second on one
#: core, large enough that matrix products dominate it.
CHECK_MODEL = Transformer(layers=2, hidden=768, heads=12, seq_len=64, micro_batch=1)

_KIB = 1024


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Latency (s) and bandwidth (bytes/s) of t = latency + bytes / bandwidth, least squares on
    the relative error (weights 1/t²): a plain fit lets the largest message set the line and
    leaves the small ones' latency to noise (it came out negative, clamped to 0, here)."""
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


def seconds_per_call(fn: Any, min_seconds: float) -> float:
    """Mean seconds of ``fn`` over calls lasting at least ``min_seconds`` in all.

    A mean over a window, not the median of short calls: a step lasts many of the scheduler's
    time slices and loses its share of them to whatever else runs, and so must the calibration.
    """
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def layer_step(model: Transformer) -> tuple[Any, float]:
    """One GPTLayer's training step (forward and backward) on one micro-batch of ``model``, and
    its FLOPs as :func:`~mgtutor.plan.step_time.compute_flops` counts them."""
    import torch

    from mgtutor.parallel.gpt_layer import GPTLayer

    layer = GPTLayer(model.hidden, model.heads, p=0.0)
    x = torch.randn(model.micro_batch, model.seq_len, model.hidden)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).pow(2).mean().backward()

    step()
    one = replace(model, layers=1, vocab=0, params=None)
    return step, compute_flops(one, model.micro_batch * model.seq_len)


def bare_matmul(model: Transformer) -> tuple[Any, float]:
    """The MLP's first matrix product of one micro-batch, bare, and its FLOPs."""
    import torch

    m, k, n = model.micro_batch * model.seq_len, model.hidden, model.ffn or 4 * model.hidden
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    return (lambda: a @ b), 2.0 * m * k * n


def _rate(kind: str, model: Transformer, window: float) -> float:
    """FLOP/s of ``kind`` ("step": one layer's training step; "matmul": a bare product)."""
    fn, flops = (layer_step if kind == "step" else bare_matmul)(model)
    return flops / seconds_per_call(fn, window)


def _mean_seconds(fn: Any, calls: int, work: Any = None) -> float:
    """Mean seconds of ``calls`` calls of ``fn`` (a fixed count, as every rank must make the
    same number of collectives), each after a call of ``work`` that is not timed."""
    total = 0.0
    for _ in range(calls):
        if work is not None:
            work()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    return total / calls


def _together_mean(call: Any, calls: int, work: Any, per_call: int = 1) -> float:
    """Mean seconds of one of ``per_call`` collectives in ``call``, timed as
    :func:`_mean_seconds` does after the ranks start together: a barrier and one untimed call
    first, since whatever ran before ended at a different moment on each rank and the first
    call would wait out that difference, which no step's call does."""
    import torch.distributed as dist

    dist.barrier()
    call()
    return _mean_seconds(call, calls, work) / per_call


def needs_gloo_ranks(pool: Any) -> None:
    """Raise ValueError unless ``pool`` has 2 gloo ranks: the check's tensors stay on the CPU,
    which NCCL (what :func:`mgtutor.setup` picks where each rank has a GPU) cannot reduce."""
    if getattr(pool, "world_size", 2) != 2 or getattr(pool, "backend", "gloo") != "gloo":
        raise ValueError(
            f"the step-time check runs on 2 gloo ranks, got {pool!r}: use "
            "mgtutor.Pool(2, backend='gloo') (CPU ranks, on a GPU machine too)"
        )


def _ping(t: Any, rank: int) -> None:
    """Rank 0 sends ``t`` to rank 1, which sends it back: two sends."""
    import torch.distributed as dist

    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    else:
        dist.recv(t, 0)
        dist.send(t, 0)


def small_calls(model: Transformer) -> dict[str, Any]:
    """Timers of the smallest collectives a step of ``model`` sends on 2 ranks, one
    micro-batch's activation: ``"all_reduce"`` (tensor parallelism's) and ``"send"`` (the
    pipeline's). Each timer takes a call count (every rank the same) and returns the mean
    seconds of one call, each after a bare product on every rank, as :func:`calibrate` times
    them."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(model.micro_batch * model.seq_len * model.hidden)
    work, rank = bare_matmul(model)[0], dist.get_rank()

    return {
        "all_reduce": lambda calls: _together_mean(lambda: dist.all_reduce(t), calls, work),
        "send": lambda calls: _together_mean(lambda: _ping(t, rank), calls, work, per_call=2),
    }


def with_latencies(hardware: Hardware, model: Transformer, seconds: dict[str, float]) -> Hardware:
    """``hardware`` with its links' per-call latencies re-read from ``seconds`` (as
    :func:`small_calls` measures them: one call of a micro-batch's activation) less that
    message's bytes over the link's bandwidth; the bandwidths stay."""
    size = 4 * model.micro_batch * model.seq_len * model.hidden
    link = hardware.intra
    p2p_bandwidth = link.p2p_bandwidth or link.bandwidth
    link = replace(
        link,
        latency=max(seconds.get("all_reduce", 0.0) - size / link.bandwidth, 0.0)
        if "all_reduce" in seconds
        else link.latency,
        p2p_latency=max(seconds["send"] - size / p2p_bandwidth, 0.0)
        if "send" in seconds
        else link.p2p_latency,
    )
    return replace(hardware, intra=link, inter=link)


def _calibrate_rank(
    model: Transformer, sizes: list[int], window: float, calls: int, after_compute: bool
) -> dict:
    """One rank's side of :func:`calibrate` (every rank runs the same)."""
    import torch
    import torch.distributed as dist

    from mgtutor.worker import setup

    setup()
    rank = dist.get_rank()
    flops = {}
    # Rank 0 alone (the one-process configuration), then both ranks at once (every other).
    for kind in ("step", "matmul"):
        for busy in ("alone", "together"):
            dist.barrier()
            if busy == "together" or rank == 0:
                flops[kind, busy] = _rate(kind, model, window)
    # A step meets each collective after a stretch of compute: the ranks arrive when their own
    # compute ends, and the later one sets when the collective ends. Back to back they arrive
    # together, which no step does.
    work = bare_matmul(model)[0] if after_compute else None
    # DDP's bucket copies (step_time's "copies"): the model's float32 gradients copied, on both
    # ranks at once (larger than a cache, as a model's gradients are).
    src = torch.randn(model.total)
    dst = torch.empty_like(src)
    dist.barrier()
    copy_rate = 4 * model.total / seconds_per_call(lambda: dst.copy_(src), window / 2)
    reduce_s, send_s = [], []
    for size in sizes:
        t = torch.zeros(size // 4)
        reduce_s.append(_together_mean(lambda t=t: dist.all_reduce(t), calls, work))
        send_s.append(_together_mean(lambda t=t: _ping(t, rank), calls, work, per_call=2))
    return {"flops": flops, "all_reduce": reduce_s, "send": send_s, "copy": copy_rate}


def calibrate(
    pool: Any,
    *,
    model: Transformer = CHECK_MODEL,
    sizes: tuple[int, ...] | None = None,
    window: float = 0.5,
    calls: int = 20,
    rate: str = "step",
    after_compute: bool = True,
) -> Hardware:
    """Measure this machine's 2 CPU ranks as a :class:`~mgtutor.plan.step_time.Hardware`.

    Args:
        pool: a :class:`mgtutor.Pool` of 2 gloo ranks to measure on
            (``mgtutor.Pool(2, backend="gloo")``).
        model: the shape whose layer step (and MLP product) is timed.
        sizes: message sizes in bytes of the all-reduce and send/recv fits; by default those a
            step of ``model`` sends: one micro-batch's activation (TP's all-reduces, the
            pipeline's sends), 1 MiB, and DDP's full gradient bucket.
        window: seconds each FLOP/s is averaged over.
        calls: all-reduces (and round trips) timed per message size.
        after_compute: time each call after a bare product on each rank, as a step meets its
            collectives (ranks arriving apart); False: back to back, which predicts too fast.
        rate: "step" (the achieved rate of a layer's training step, the default) or "matmul"
            (a bare product's, which predicts too fast; kept to show by how much).

    Returns:
        Hardware with ``flops["fp32"]`` (the slower rank's, both ranks busy at once) and
        ``flops["fp32_alone"]`` (rank 0 busy, rank 1 idle) of ``rate``; ``"matmul"`` and
        ``"matmul_alone"`` the bare product's for comparison; gloo's all-reduce as the link (a
        2-rank ring sends the whole buffer: 2(n-1)/n = 1) and send/recv as its point-to-point
        figures, ``overlap=0`` (gloo reduces on the cores that compute), and ``copy``, the
        slower rank's bytes/s copying the model's gradients while the other copies too.
    """
    from mgtutor.hardware import describe_hardware

    if rate not in ("step", "matmul"):
        raise ValueError(f"rate must be 'step' or 'matmul', got {rate!r}")
    needs_gloo_ranks(pool)
    activation = 4 * model.micro_batch * model.seq_len * model.hidden
    bucket = min(DDP_BUCKET_BYTES, 4 * model.total)  # float32 gradients, DDP's bucket cap
    sizes = sizes or (activation, 1024 * _KIB, bucket)
    run = pool.run(_calibrate_rank, model, list(sizes), window, calls, after_compute, quiet=True)
    results = run.results

    def of(kind: str, busy: str) -> float:  # rank 0's alone; the slower rank's together
        rates = [r["flops"][kind, busy] for r in results if (kind, busy) in r["flops"]]
        return min(rates)

    flops = {"fp32": of(rate, "together"), "fp32_alone": of(rate, "alone")}
    flops.update(matmul=of("matmul", "together"), matmul_alone=of("matmul", "alone"))
    reduce_s = [max(r["all_reduce"][i] for r in results) for i in range(len(sizes))]
    send_s = [max(r["send"][i] for r in results) for i in range(len(sizes))]
    latency, bandwidth = _fit(list(sizes), reduce_s)
    p2p_latency, p2p_bandwidth = _fit(list(sizes), send_s)
    link = Link(bandwidth, latency, p2p_bandwidth, p2p_latency)
    return Hardware(
        name="this machine's CPU ranks, gloo over loopback (1 thread per rank)",
        flops=flops,
        intra=link,
        inter=link,
        gpus_per_node=2,
        memory=describe_hardware().memory_bytes // 2,
        overlap=0.0,
        copy=min(r["copy"] for r in results),
        source=f"calibrate(): {rate} FLOP/s of {model}, on each rank at once and on rank 0 "
        f"alone; gloo all_reduce and send/recv at {list(sizes)} bytes, relative least squares; "
        "a copy of the float32 gradients on each rank at once",
    )
