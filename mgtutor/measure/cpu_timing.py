"""What a CPU rank's compute costs, timed: each product of a layer as autograd runs it, each
memory-bound operation per element, and how fast the rank computes now.

:func:`gemm_shapes` lists a layer's products; :func:`product_timers` times each the three ways
autograd runs it (forward, input gradient, weight gradient) on operands out of cache, as a step
meets its weights; :func:`elementwise_timers` times LayerNorm, the residual add, the masked
softmax and GeLU forward and backward; :func:`seconds_per_call` times any of them on a clock
(``time.process_time`` for CPU seconds, which other work on the machine does not stretch);
:func:`reference_rate` is the one product re-timed before each step; :func:`gemm_timer` any
one product.
:mod:`mgtutor.experiments.step_calibrate` turns them into a
:class:`~mgtutor.plan.machine.Hardware`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mgtutor.plan.compute_time import product_shapes
from mgtutor.plan.shape import Transformer

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")

__all__ = [
    "COLD_BYTES",
    "elementwise_timers",
    "gemm_shapes",
    "gemm_timer",
    "product_timers",
    "reference_rate",
    "seconds_per_call",
]


def gemm_shapes(model: Transformer, tps: tuple[int, ...] = (1, 2)) -> list[tuple[int, ...]]:
    """Every product a layer of ``model`` runs on one of ``tp`` ranks, forward, as (rows, inner,
    cols, count): :func:`calibrate` times each with its two backward products."""
    found: dict[tuple[int, int, int], int] = {}
    for tp in tps:
        first, second, core = product_shapes(model, tp)
        for r, k, c, n in first + second + core:
            found.setdefault((r, k, c), int(n))
    return [(*shape, n) for shape, n in found.items()]


#: Inputs rotate through copies of at least this many bytes, so that no timed call finds its
#: operands in a cache the step would not have them in (a layer meets each weight once a step).
COLD_BYTES = 64 * 2**20


def _cold(make: Callable[[], _T], nbytes: float) -> Callable[[], _T]:
    """A function returning ``make()``'s instances in turn, enough of them to fill
    :data:`COLD_BYTES` (``nbytes`` each)."""
    import itertools

    return itertools.cycle([make() for _ in range(max(1, math.ceil(COLD_BYTES / nbytes)))]).__next__


def product_timers(
    shape: tuple[int, ...],
) -> dict[tuple[int, int, int], Callable[[], torch.Tensor]]:
    """The three products of one forward product of ``shape``, as autograd runs them: keyed
    (rows, inner, cols) forward, (rows, cols, inner) for the input's gradient and (inner, rows,
    cols) for the weight's (a linear: ``x @ w.T``, ``g @ w``, ``g.T @ x``; the attention core:
    batched, ``a @ b`` (``baddbmm`` for the scores, as GPTLayer), ``g @ b.T``, ``a.T @ g``), on
    operands not in a cache."""
    import torch

    rows, inner, cols, n = shape
    nbytes = 4 * n * (rows * inner + inner * cols + rows * cols)
    if n > 1:
        take = _cold(lambda: (torch.randn(n, rows, inner), torch.randn(n, inner, cols),
                              torch.randn(n, rows, cols)), nbytes)  # fmt: skip

        def fwd() -> torch.Tensor:  # GPTLayer scales q kᵀ in the product: baddbmm, as it runs it
            a, b, g = take()
            if rows == cols:
                return torch.baddbmm(g, a, b, beta=0.0, alpha=0.125)
            return torch.bmm(a, b)

        def dgrad() -> torch.Tensor:
            _, b, g = take()
            return torch.bmm(g, b.transpose(1, 2))

        def wgrad() -> torch.Tensor:
            a, _, g = take()
            return torch.bmm(a.transpose(1, 2), g)

        return {(rows, inner, cols): fwd, (rows, cols, inner): dgrad, (inner, rows, cols): wgrad}
    take = _cold(lambda: (torch.randn(rows, inner), torch.randn(cols, inner),
                          torch.randn(rows, cols)), nbytes)  # fmt: skip

    def linear() -> torch.Tensor:
        x, w, _ = take()
        return x @ w.T

    def linear_dgrad() -> torch.Tensor:
        _, w, g = take()
        return g @ w

    def linear_wgrad() -> torch.Tensor:
        x, _, g = take()
        return g.T @ x

    return {
        (rows, inner, cols): linear,
        (rows, cols, inner): linear_dgrad,
        (inner, rows, cols): linear_wgrad,
    }


def seconds_per_call(
    fn: Callable[[], object],
    min_seconds: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Mean seconds of ``fn`` on ``clock`` over calls lasting at least ``min_seconds`` in all: a
    mean over a window, as a step loses its share of the machine's time slices to whatever else
    runs. ``clock=time.process_time``: the CPU seconds this process spent, which other work on
    the machine does not stretch. One untimed call first: a first call pays for lazy set-up
    (a kernel library's, the allocator's)."""
    fn()
    calls, start = 0, clock()
    while True:
        fn()
        calls += 1
        elapsed = clock() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def gemm_timer(shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """A timer of the forward product of ``shape`` (rows, inner, cols, count)."""
    return product_timers(shape)[(shape[0], shape[1], shape[2])]


def elementwise_timers(model: Transformer) -> dict[str, tuple[Callable[[], None], int]]:
    """Each memory-bound operation of a GPT layer, forward and backward, and its elements:
    LayerNorm and the residual add over b·s·h, the softmax over the scaled scores with the
    causal mask added, GeLU over b·s·ffn."""
    import torch
    import torch.nn.functional as F

    b, s, h, a = model.micro_batch, model.seq_len, model.hidden, model.heads
    ffn = model.ffn or 4 * h
    mask = torch.full((s, s), float("-inf")).triu(1)
    norm = torch.nn.LayerNorm(h)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, requires_grad=True)

    def both_ways(out: torch.Tensor, grad: torch.Tensor, *leaves: torch.Tensor) -> None:
        # autograd takes the buffer
        for t in (*leaves, *norm.parameters()):
            t.grad = None
        out.backward(grad)

    # Each operation reads what the previous one just wrote: its operands stay where a cache
    # holds them, unlike the products' weights.
    xs, ws, ss = (leaf(b, s, h), leaf(b, s, h), torch.randn(b, s, h)), None, None
    ws = (leaf(b, s, ffn), torch.randn(b, s, ffn))
    ss = (leaf(b * a, s, s), torch.randn(b * a, s, s))

    def take_x() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return xs

    def take_w() -> tuple[torch.Tensor, torch.Tensor]:
        return ws

    def take_s() -> tuple[torch.Tensor, torch.Tensor]:
        return ss

    def layernorm() -> None:
        x, _, g = take_x()
        both_ways(norm(x), g, x)

    def residual() -> None:
        x, y, g = take_x()
        both_ways(x + y, g, x, y)

    def softmax() -> None:  # the mask added in place, as GPTLayer does, then softmax both ways
        scores, g = take_s()
        scores.detach().add_(mask)
        both_ways(F.softmax(scores, -1), g, scores)

    def gelu() -> None:
        w, g = take_w()
        both_ways(F.gelu(w), g, w)

    return {
        "layernorm": (layernorm, b * s * h),
        "residual": (residual, b * s * h),
        "softmax": (softmax, b * a * s * s),
        "gelu": (gelu, b * s * ffn),
    }


def reference_rate(
    model: Transformer, window: float, clock: Callable[[], float] = time.perf_counter
) -> float:
    """FLOP/s of the MLP's first product of ``model``, over ``window`` seconds of ``clock``: how
    fast this rank computes now (:func:`scaled` moves every calibrated rate by its change)."""
    h = model.hidden
    shape = (model.micro_batch * model.seq_len, h, model.ffn or 4 * h, 1)
    return 2.0 * shape[0] * shape[1] * shape[2] / seconds_per_call(gemm_timer(shape), window, clock)
