"""Notebook 13's exercise: Megatron-LM's f and g, the two conjugate tensor-parallel functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import Finding, call_learner, everyone_ok, make_finding

__all__ = ["CASES", "EXERCISE", "check_tensor_parallel_pair", "run"]

CASES = (
    "copy_to_parallel's forward: each rank gets its own x back, unchanged",
    "copy_to_parallel's backward: x's gradient is the sum of every rank's upstream gradient",
    "reduce_from_parallel's forward: the sum of every rank's x",
    "reduce_from_parallel's backward: each rank's own upstream gradient, unchanged",
    "an MLP split column-wise then row-wise: output and every gradient equal to one process",
)
_SHAPE = (2, 3, 4)


def check_tensor_parallel_pair(
    copy_to_parallel: Callable[..., Any],
    reduce_from_parallel: Callable[..., Any],
    *,
    timeout: float = 20.0,
) -> CheckResult:
    """Check Megatron-LM's f and g, the conjugate pair around a tensor-parallel region.

    The exercise: write ``copy_to_parallel(x)`` (f: x unchanged in forward, its gradient
    all-reduced in backward) and ``reduce_from_parallel(x)`` (g: x all-reduced in forward, the
    gradient unchanged in backward), each returning ``SomeFunction.apply(x)`` of a
    ``torch.autograd.Function`` you write.

    The checker runs them on 2 ranks: each function alone, forward and backward, with a
    different input and a different upstream gradient on each rank; then an MLP split
    column-wise (the up layer's rows) then row-wise (the down layer's columns) with ``f``
    before it and ``g`` after it, whose output and every gradient must equal the same MLP in
    one process. It recognizes an all-reduce in both directions, none at all, a sum where a
    copy belongs, and a mean where a sum belongs.

    Args:
        copy_to_parallel: your f.
        reduce_from_parallel: your g.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: either argument is not a function.
    """
    return check(EXERCISE, (copy_to_parallel, reduce_from_parallel), timeout)


def _pair_input(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randint(-5, 6, _SHAPE, generator=gen).double().requires_grad_()


def _close(a: Any, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a.detach().double(), b.double(), rtol=1e-9, atol=1e-9)
    )


def _forward_and_backward(index, case, fn, rank, world):
    """fn on this rank's x; backward with upstream gradient rank + 1 everywhere."""
    x = _pair_input(rank)
    y = call_learner(index, case, fn, x)
    if isinstance(y, torch.Tensor) and y.requires_grad:
        call_learner(index, case, lambda: y.backward(torch.full(_SHAPE, rank + 1.0).double()))
    inputs = [_pair_input(r).detach() for r in range(world)]
    return x, y, inputs


def _verdict(case: str, got: Any, want: torch.Tensor, wrong: dict[str, tuple]) -> Finding:
    if _close(got, want):
        return make_finding(case)
    if isinstance(got, str):
        return make_finding(
            case,
            got,
            "wrap the operation in a torch.autograd.Function and return "
            "Function.apply(x), so that autograd calls its backward",
        )
    for value, detail, hint in wrong.values():
        if _close(got, value):
            return make_finding(case, detail, hint)
    shown = got.detach().reshape(-1)[:3].tolist() if isinstance(got, torch.Tensor) else got
    return make_finding(
        case,
        f"got {type(got).__name__} {shown!r:.80}, expected {want.reshape(-1)[:3].tolist()}...",
        "return a tensor of x's shape from forward, and x's gradient from backward",
    )


def _unit_cases(index, f, g, rank, world) -> list[Finding]:
    total_grad = torch.full(_SHAPE, sum(r + 1.0 for r in range(world))).double()
    own_grad = torch.full(_SHAPE, rank + 1.0).double()
    findings = []
    x, y, inputs = _forward_and_backward(index, CASES[0], f, rank, world)
    summed = sum(inputs)
    no_grad = "x has no gradient: forward's output must come from an autograd.Function"
    findings.append(
        _verdict(
            CASES[0],
            y,
            inputs[rank],
            {
                "summed": (
                    summed,
                    "forward returned the sum over the ranks: it all-reduces where it should copy",
                    "every rank already holds the whole x; f only marks where the parallel "
                    "region begins: return x unchanged (x.view_as(x)) in forward",
                )
            },
        )
    )
    if not everyone_ok(findings[-1]):
        return findings
    findings.append(
        _verdict(
            CASES[1],
            x.grad if x.grad is not None else no_grad,
            total_grad,
            {
                "own": (
                    own_grad,
                    "x's gradient is this rank's upstream gradient only: backward does not "
                    "all-reduce",
                    "each rank's part of the layer used the whole x, so x's gradient is the sum "
                    "of every rank's contribution: dist.all_reduce a copy of grad in backward",
                )
            },
        )
    )
    if not everyone_ok(findings[-1]):
        return findings
    x, y, inputs = _forward_and_backward(index, CASES[2], g, rank, world)
    findings.append(
        _verdict(
            CASES[2],
            y,
            summed,
            {
                "copied": (
                    inputs[rank],
                    "forward returned this rank's x unchanged: it does not all-reduce",
                    "each rank holds a partial sum of the output; g adds them up: all-reduce a "
                    "copy of x in forward",
                ),
                "mean": (
                    summed / world,
                    f"forward returned the mean over the ranks, {world} times too small",
                    "the partial products add up to the output: sum them (ReduceOp.SUM), do not "
                    "average",
                ),
            },
        )
    )
    if not everyone_ok(findings[-1]):
        return findings
    findings.append(
        _verdict(
            CASES[3],
            x.grad if x.grad is not None else no_grad,
            own_grad,
            {
                "summed": (
                    total_grad,
                    "x's gradient is the sum of every rank's upstream gradient: backward "
                    "all-reduces too (an all-reduce in both directions)",
                    "after g every rank holds the same output, and the gradient of each rank's "
                    "partial sum is the output's gradient itself: return grad unchanged",
                )
            },
        )
    )
    return findings


def _mlp_case(index, f, g, rank, world) -> Finding:
    case = CASES[4]
    gen = torch.Generator().manual_seed(3)
    w1, b1 = torch.randn(8, 4, generator=gen).double(), torch.randn(8, generator=gen).double()
    w2, b2 = torch.randn(4, 8, generator=gen).double(), torch.randn(4, generator=gen).double()
    x = torch.randn(*_SHAPE, generator=gen).double()
    full = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y_full = F.linear(F.gelu(F.linear(full[0], full[1], full[2])), full[3], full[4])
    y_full.pow(2).sum().backward()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    mine = [t.clone().requires_grad_() for t in (x, w1[rows], b1[rows], w2[:, rows], b2)]
    hidden = F.gelu(F.linear(call_learner(index, case, f, mine[0]), mine[1], mine[2]))
    y = call_learner(index, case, g, F.linear(hidden, mine[3])) + mine[4]
    call_learner(index, case, lambda: y.pow(2).sum().backward())
    if not _close(y, y_full):
        return make_finding(case, "the output differs from one process", "")
    names = (
        "x",
        "the up weight's rows",
        "the up bias's rows",
        "the down weight's columns",
        "the down bias",
    )
    grads = []
    for t in full:
        assert t.grad is not None  # the one-process layer: its loss reaches every input
        grads.append(t.grad)
    expected = (grads[0], grads[1][rows], grads[2][rows], grads[3][:, rows], grads[4])
    for name, got, want in zip(names, mine, expected):
        if not _close(got.grad, want):
            return make_finding(
                case,
                f"the gradient of {name} differs from one process",
                "the four cases before passed, so this is how the functions combine: return new "
                "tensors (no in-place all-reduce on x or grad) from both functions",
            )
    return make_finding(case)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    f, g = cloudpickle.loads(payload)
    findings = _unit_cases(index, f, g, rank, world)
    if len(findings) == 4 and everyone_ok(findings[-1]):
        findings.append(_mlp_case(index, f, g, rank, world))
    return findings


EXERCISE = Exercise(
    key="tensor_parallel_pair",
    name="copy_to_parallel / reduce_from_parallel",
    functions=("copy_to_parallel", "reduce_from_parallel"),
    world_size=2,
    cases=CASES,
    run=run,
    reference=(solutions.copy_to_parallel, solutions.reduce_from_parallel),
    hang_hint="a collective that not every rank calls waits forever: each function's all-reduce "
    "runs on every rank, with no condition on the rank",
)
