"""A GPU rank emulated on a CPU rank, so that what the step-time model says about overlap and
schedules can be checked on a busy 2-core machine.

On a GPU the host hands work to the device and to NCCL and goes on; the device computes while a
collective moves on its own stream. Here both are slept: a product of a declared shape sleeps the
seconds a declared :class:`~mgtutor.plan.compute_time.Device` takes for it, and a collective
sleeps its declared bytes over a declared bandwidth on a :class:`Wire`, a thread that moves one
transfer at a time (a one-element all-reduce on its own gloo group first, so that both ranks
start it together). A sleep takes no core, so the two overlap as a GPU's would, and other work on
the machine barely stretches them. The tensors are tiny; what runs for real is torch's order of
events: autograd's, DDP's reducer (its buckets, its hooks, ``no_sync``), torch's pipeline
schedule. The links carry no gradient: the emulated device times a step, it does not train.

:class:`EmulatedLayer` is a GPT layer of declared shape split over ``tp`` ranks as Megatron-LM
splits it (q-k-v and fc1 by columns, the projection and fc2 by rows, the attention core by
heads), its forward all-reduces after each row-parallel product, its backward all-reduces each
column-parallel input's gradient while it computes that product's weight gradient
(``overlap=True``, Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``) or after it.
:func:`ddp_hook` sends DDP's buckets over a wire; :class:`Stamp` and :class:`Unstamp` delay a
pipeline's activations and gradients by a wire's seconds between two stages.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mgtutor.plan.compute_time import Device, gemm_seconds, product_shapes
from mgtutor.plan.shape import Transformer

__all__ = [
    "EmulatedLayer",
    "Stamp",
    "Unstamp",
    "Wire",
    "ddp_hook",
    "device_idle",
    "device_resume",
    "device_sleep",
    "emulated_device",
    "meeting_seconds",
    "wire_group",
]

#: Real width of every tensor: each layer's four weights are 1 MiB of float32, so that DDP puts
#: one layer in each bucket whatever its first bucket's size (1 MiB in torch 2.11, the cap later).
REAL_HIDDEN = 256
# new_group's type allows a rank outside the group; every rank is in this one.
_GROUP: list[Any] = []
#: A late wake-up shorter than this is the host's, not the device's: the next block still ends
#: its seconds after the previous one's end, as a GPU's queued kernels do. On a 2-core machine
#: whose cores two other busy processes share, a sleeping rank wakes up to about 10 ms late.
LATE = 0.015
_DEVICE = {"end": 0.0}


def _sleep(seconds: float) -> None:
    """Sleep ``seconds`` (none if negative); an emulated step never sleeps a minute."""
    if not 0 <= seconds < 60:
        if seconds < 0:
            return
        raise RuntimeError(f"an emulated sleep of {seconds} s: a clock went wrong")
    time.sleep(seconds)


def device_sleep(seconds: float) -> None:
    """Sleep as a GPU computes: until ``seconds`` after the previous device work ended, if that
    was less than :data:`LATE` ago (a sleep woke late: the device would have gone on), else
    after now (the device idled, waiting for data)."""
    now = time.perf_counter()
    start = _DEVICE["end"] if 0 <= now - _DEVICE["end"] < LATE else now
    _DEVICE["end"] = start + seconds
    _sleep(_DEVICE["end"] - now)


def device_idle() -> None:
    """The device waited for data: its next work starts now."""
    _DEVICE["end"] = 0.0


def device_resume(at: float) -> None:
    """The device waited for data that arrived at ``at`` (``time.perf_counter``): its next
    work starts then, if the host woke within :data:`LATE` of it (the device does not wait for
    the host), else when the host gets to it."""
    _DEVICE["end"] = max(_DEVICE["end"], at)


def emulated_device(model: Transformer, tp: int, rate: float, slow_wgrad: float = 1.0) -> Device:
    """A device running every product of ``model``'s layer (on one of ``tp`` ranks) at ``rate``
    FLOP/s, but the column-parallel weight gradients ``slow_wgrad`` times slower (a longer
    product for TP's backward all-reduce to hide behind); no memory-bound operation."""
    rates: dict[tuple[int, int, int], float] = {}
    first, second, core = product_shapes(model, tp)
    for r, k, c, _ in second + core:
        for shape in ((r, k, c), (r, c, k), (k, r, c)):
            rates[shape] = rate
    for r, k, c, _ in first:
        rates[(r, k, c)] = rates[(r, c, k)] = rate
        rates[(k, r, c)] = rate / slow_wgrad
    return Device("emulated GPU", gemm_rates=rates)


def wire_group() -> dist.ProcessGroup:
    """This rank's gloo group for wires (made once per process; every rank must call it)."""
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


class _Transfer:
    def __init__(self, seconds: float, then: Callable[[], object] | None = None) -> None:
        self.seconds, self.done = seconds, threading.Event()
        self.then: Any = then  # the wire's thread puts its exception here
        self.issued = time.time()  # the ranks compare these: one clock for the machine
        self.end = 0.0  # when it ended on the wire (time.perf_counter)

    def wait(self) -> None:
        self.done.wait()
        if isinstance(self.then, BaseException):
            raise RuntimeError("the emulated wire's thread failed") from self.then
        device_resume(self.end)


class Wire:
    """A link of ``bandwidth`` bytes/s between this rank and the other, emulated: transfers run
    one after another on a thread, each a one-element all-reduce (the ranks meet and agree when
    the later one issued it) then a sleep until bytes / bandwidth after that, or after the
    previous transfer's end. ``start`` returns at once; ``wait`` on what it returns."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth, self.group = bandwidth, wire_group()
        self._jobs: queue.Queue[_Transfer | None] = queue.Queue()
        self._token = torch.zeros(1, dtype=torch.float64)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        end = 0.0  # when the previous transfer ended on the wire
        while (job := self._jobs.get()) is not None:
            try:
                # The ranks meet, and learn when the later of them issued the transfer: it
                # starts then, or when the wire is free, however late this thread woke.
                self._token.fill_(job.issued)
                dist.all_reduce(self._token, op=dist.ReduceOp.MAX, group=self.group)
                now = time.perf_counter()
                issued = now - (time.time() - float(self._token))
                end = max(end, issued) + job.seconds
                _sleep(end - now)
                job.end = end
                if job.then is not None:
                    job.then()
            except BaseException as exc:  # the waiting thread raises it: none may hang
                job.then = exc
            job.done.set()

    def start(self, nbytes: float, then: Callable[[], object] | None = None) -> _Transfer:
        """Queue a transfer of ``nbytes``; ``then()`` runs on the wire's thread when it ends."""
        job = _Transfer(nbytes / self.bandwidth, then)
        self._jobs.put(job)
        return job

    def send(self, nbytes: float) -> None:
        """A transfer, waited for."""
        self.start(nbytes).wait()

    def close(self) -> None:
        """End the thread once the queued transfers are done."""
        self._jobs.put(None)
        self._thread.join()


def meeting_seconds(wire: Wire, calls: int, work: float = 0.004) -> float:
    """Mean seconds of an empty transfer on ``wire`` after ``work`` seconds of device time on
    each rank, as a step meets its collectives: mostly the wait for the later rank, whose
    sleeps woke later (the wire's latency in a step, re-timed before each)."""
    total = 0.0
    for _ in range(calls):
        device_idle()
        device_sleep(work)
        start = time.perf_counter()
        transfer = wire.start(0.0)
        transfer.wait()
        total += transfer.end - start  # to its end on the wire, not to this thread's wake-up
    return total / calls


def ddp_hook(state: tuple[Wire, dict[int, int]], bucket):
    """A DDP communication hook sending each bucket over ``state``'s wire: the bucket's bytes
    are the declared bytes of its parameters (``state[1]``: id(parameter) -> bytes).

    ``bucket`` and the result carry no annotation: DDP refuses a hook whose annotations are not
    its own classes, and this module's annotations are strings (``from __future__``)."""
    wire, declared = state
    future: torch.futures.Future = torch.futures.Future()
    nbytes = sum(declared.get(id(p), 0) for p in bucket.parameters())
    buffer = bucket.buffer()
    wire.start(nbytes, then=lambda: future.set_result(buffer))
    return future


class _Block(torch.autograd.Function):
    """(x @ a) @ b on tiny tensors standing for a block of declared products: forward sleeps
    ``seconds[0]``; backward sleeps ``seconds[1]`` (every product's backward but the first
    one's weight gradient), then ``seconds[2]`` (that weight gradient). ``reduce`` (wire,
    bytes, overlap) all-reduces the block's input gradient: during the last sleep (Megatron-LM's
    overlap) or after it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                seconds: tuple[float, float, float],
                reduce: tuple[Wire, float, bool] | None) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, a, b)
        ctx.seconds, ctx.reduce = seconds, reduce
        if not x.is_meta:
            device_sleep(seconds[0])
        return x @ a @ b

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        x, a, b = ctx.saved_tensors
        device_sleep(ctx.seconds[1])
        h = x @ a
        grad_h = grad @ b.T
        grad_b = h.flatten(0, -2).T @ grad.flatten(0, -2)
        grad_x = grad_h @ a.T
        pending = None
        if ctx.reduce is not None and ctx.reduce[2]:
            pending = ctx.reduce[0].start(ctx.reduce[1])
        device_sleep(ctx.seconds[2])
        grad_a = x.flatten(0, -2).T @ grad_h.flatten(0, -2)
        if pending is not None:
            pending.wait()
        elif ctx.reduce is not None:
            ctx.reduce[0].send(ctx.reduce[1])
        return grad_x, grad_a, grad_b, None, None


class _AllReduce(torch.autograd.Function):
    """Identity that sends ``nbytes`` over a wire in forward (the row-parallel output's
    all-reduce, Megatron-LM's g), nothing in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wire: Wire, nbytes: float) -> torch.Tensor:
        if not x.is_meta:
            wire.send(nbytes)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class EmulatedLayer(nn.Module):
    """One GPT layer of ``model``'s declared shape on ``device``, split over ``tp`` ranks, as
    two blocks: attention (q-k-v, the core, the projection) and the MLP (fc1, fc2).

    Each block's forward sleeps its products' forward seconds
    (:func:`~mgtutor.plan.compute_time.gemm_seconds` of each sharded shape; the attention core
    its two batched products, backward twice that, as
    :func:`~mgtutor.plan.compute_time.layer_times` counts); its backward sleeps the rest, the
    column-parallel product's weight gradient last. No memory-bound operation (the device has
    none). A sleep per block, not per product: each sleep oversleeps by about 0.3 ms on a busy
    machine. With ``wire`` and ``tp`` > 1, tensor parallelism's all-reduces carry b·s·h float32
    bytes: after each block forward, and of each block's input gradient in backward.

    Attributes:
        declared: id(parameter) -> the bytes the parameter stands for (float32).
    """

    def __init__(
        self, model: Transformer, device: Device, tp: int = 1, wire: Wire | None = None,
        overlap: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        b, s, h, a = model.micro_batch, model.seq_len, model.hidden, model.heads
        ffn, tokens, prec = model.ffn or 4 * h, b * s, "fp32"
        shapes = {"qkv": (tokens, h, 3 * h // tp), "proj": (tokens, h // tp, h),
                  "fc1": (tokens, h, ffn // tp), "fc2": (tokens, ffn // tp, h)}  # fmt: skip
        f, dg, wg = (
            {n: gemm_seconds(device, prec, *order(r, k, c)) for n, (r, k, c) in shapes.items()}
            for order in (lambda r, k, c: (r, k, c), lambda r, k, c: (r, c, k),
                          lambda r, k, c: (k, r, c))
        )  # fmt: skip
        heads, d = b * a / tp, h // a
        core = sum(gemm_seconds(device, prec, *shape, heads) for shape in ((s, d, s), (s, s, d)))
        self.seconds = {
            "attention": (f["qkv"] + core + f["proj"],
                          dg["proj"] + wg["proj"] + 2 * core + dg["qkv"], wg["qkv"]),
            "mlp": (f["fc1"] + f["fc2"], dg["fc2"] + wg["fc2"] + dg["fc1"], wg["fc1"]),
        }  # fmt: skip
        self.weights = nn.ParameterDict(
            {n: nn.Parameter(torch.randn(REAL_HIDDEN, REAL_HIDDEN) / 16) for n in shapes}
        )
        self.declared = {id(self.weights[n]): 4 * k * c for n, (_, k, c) in shapes.items()}
        self.wire = wire if tp > 1 else None
        self.nbytes, self.overlap = 4.0 * tokens * h, overlap

    def _block(self, x: torch.Tensor, name: str, first: str, second: str) -> torch.Tensor:
        reduce = (self.wire, self.nbytes, self.overlap) if self.wire else None
        w = self.weights
        y = _Block.apply(x, w[first], w[second], self.seconds[name], reduce)
        return _AllReduce.apply(y, self.wire, self.nbytes) if self.wire else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._block(x, "attention", "qkv", "proj")
        return x + self._block(x, "mlp", "fc1", "fc2")


def _encode(t: float) -> tuple[float, float]:  # float32 keeps 24 bits: ms and a fraction
    ms = math.floor(t * 1000)
    return float(ms % 10_000_000), t * 1000 - ms


def _since(stamp: torch.Tensor) -> float:
    """Seconds since the time written in ``stamp``'s first two elements."""
    now_ms, now_frac = _encode(time.time())
    ms = (now_ms - float(stamp[0])) % 10_000_000 + now_frac - float(stamp[1])
    return ms / 1000


#: Written beside each stamp: a row without it carries no time. torch's pipeline stages
#: infer shapes by running a stage on uninitialized tensors (stage.py, ``_to_tensor``: an empty
#: tensor from the metadata), whose "stamp" is whatever memory held.
STAMPED = 4321.0


def _stamp(x: torch.Tensor) -> torch.Tensor:
    row = torch.zeros_like(x[:, :1])
    ms, frac = _encode(time.time())
    row.view(-1)[0], row.view(-1)[1], row.view(-1)[2] = ms, frac, STAMPED
    return torch.cat([x, row], dim=1)


def _arrive(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """Sleep until ``seconds`` after the stamp in ``x``'s last row, then drop the row."""
    if not x.is_meta and float(x[:, -1].reshape(-1)[2]) == STAMPED:
        wait = seconds - _since(x[:, -1].reshape(-1))
        arrival = time.perf_counter() + wait
        _sleep(wait)
        device_resume(arrival)  # the device waited for these data, not for this host
    return x[:, :-1]


class _StampFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return torch.cat([x, torch.zeros_like(x[:, :1])], 1) if x.is_meta else _stamp(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _arrive(grad, ctx.seconds).contiguous(), None


class _UnstampFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        return _arrive(x, seconds).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _stamp(grad), None


class Stamp(nn.Module):
    """A sending stage's last module: appends the send time to the activation (one row more
    along dim 1); its backward waits until the gradient's stamp plus ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _StampFn.apply(x, self.seconds)


class Unstamp(nn.Module):
    """A receiving stage's first module: waits until the activation's stamp plus ``seconds``
    (the wire's time), drops the row; its backward stamps the gradient."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnstampFn.apply(x, self.seconds)
