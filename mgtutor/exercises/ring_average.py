"""Notebook 02's exercise: a ring all-reduce that averages, from point-to-point messages only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    ForbiddenCollective,
    LearnerFailed,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_ring_average", "run"]

CASES = (  # label, shape, dtype
    ("12 float64 values (4 per rank)", (12,), torch.float64),
    ("10 float32 values (pieces of 4, 3 and 3)", (10,), torch.float32),
    ("a 4x5 float32 matrix", (4, 5), torch.float32),
    ("2 float64 values on 3 ranks (fewer values than ranks)", (2,), torch.float64),
    ("7 float16 values", (7,), torch.float16),
    ("a single number (a 0-d tensor, like a loss)", (), torch.float32),
)
_TOLERANCE = {torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}
# Everything that would do the exercise's work in one call; point-to-point messages
# (send, recv, isend, irecv, batch_isend_irecv) and barrier stay allowed.
_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


def check_ring_average(ring_average: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check a ring all-reduce that averages, built from point-to-point messages.

    The exercise: write ``ring_average(tensor) -> None``, which replaces ``tensor`` on every
    rank, in place, by its mean over all ranks (what DDP does to gradients), using only
    ``dist.send``/``recv``/``isend``/``irecv`` (or ``batch_isend_irecv``): a reduce-scatter
    then an all-gather around the ring. It must work for any shape (a 0-d tensor too), any
    number of elements (fewer than the ranks too) and float16, float32 or float64.

    The checker runs it on 3 ranks and compares with the mean computed from all ranks' inputs.
    Collectives (``dist.all_reduce`` and friends) raise while it runs.

    Args:
        ring_average: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``ring_average`` is not a function.

    Example:
        >>> check_ring_average(ring_average).passed
        True
    """
    return check(EXERCISE, (ring_average,), timeout)


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ForbiddenCollective(
            f"dist.{name} was called; this exercise builds the all-reduce from send/recv"
        )

    return refuse


@contextlib.contextmanager
def _collectives_refused() -> Iterator[None]:
    """Replace the collectives with functions that raise, in both modules that export them.

    The learner's function is unpickled inside this block too, so a collective it imported by
    name (``from torch.distributed import all_reduce``) resolves to the refusing one as well.
    """
    from torch.distributed import distributed_c10d

    saved = []
    for module in (dist, distributed_c10d):
        for name in _COLLECTIVES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _refusal(name))
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _ring_input(case: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(-20, 21, shape, generator=generator).to(dtype)  # exact sums


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with _collectives_refused():
        (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, shape, dtype) in enumerate(CASES):
        inputs = [_ring_input(number, r, shape, dtype) for r in range(world)]
        expected = (torch.stack([t.double() for t in inputs]).sum(0) / world).to(dtype)
        tensor = inputs[rank].clone()
        try:
            with _collectives_refused():
                returned = call_learner(index, case, fn, tensor)
        except LearnerFailed as failure:
            if failure.exc_type != ForbiddenCollective.__name__:
                raise
            findings.append(
                make_finding(
                    case,
                    f"it called a collective: {failure.message.split(';')[0]}",
                    "build the average from point-to-point messages only (dist.isend, "
                    "dist.recv, dist.irecv, dist.send): the collectives are what you rebuild",
                )
            )
        else:
            findings.append(_diagnose_ring(case, tensor, returned, inputs[rank], expected, world))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_ring(
    case: str,
    tensor: torch.Tensor,
    returned: Any,
    original: torch.Tensor,
    expected: torch.Tensor,
    world: int,
) -> Finding:
    tolerance = _TOLERANCE[expected.dtype]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(
            a.double(), b.double(), rtol=tolerance, atol=tolerance
        )

    if tensor.dtype != expected.dtype or tensor.shape != expected.shape:
        return make_finding(
            case,
            f"the tensor became {tensor.dtype} of shape {tuple(tensor.shape)}",
            "keep the tensor's shape and dtype: write the mean into it (its pieces as views)",
        )
    if close(tensor, expected):
        return make_finding(case)
    if isinstance(returned, torch.Tensor) and close(returned.reshape(expected.shape), expected):
        return make_finding(
            case,
            "returned the mean but left the tensor it was given unchanged",
            "work in place, like dist.all_reduce: tensor.copy_(result), or add into views of "
            "tensor (tensor.view(-1).tensor_split(world_size) gives such views)",
        )
    if torch.equal(tensor, original):
        return make_finding(
            case,
            "the tensor is unchanged",
            "write into the tensor itself: views of it (tensor.view(-1).tensor_split(...)), "
            "in-place operations (+=, div_, recv into a view)",
        )
    if close(tensor, expected * world):
        return make_finding(
            case,
            f"every value is {world} times the mean: the sum over the ranks",
            "divide by the world size: the sum is the ring's result, the mean is the exercise's",
        )
    wrong = ~torch.isclose(tensor.double(), expected.double(), rtol=tolerance, atol=tolerance)
    flat = wrong.view(-1)
    pieces = [p for p, part in enumerate(flat.tensor_split(world)) if part.any()]
    first = int(flat.nonzero()[0])
    return make_finding(
        case,
        f"{int(flat.sum())} of {flat.numel()} values are wrong, in piece(s) {pieces} of the "
        f"{world} that tensor_split(world_size) cuts the flattened tensor into; value {first}: "
        f"{tensor.view(-1)[first].item():g}, expected {expected.view(-1)[first].item():g}",
        "in the reduce-scatter, at step s rank r sends piece (r - s) % world and adds the piece "
        "(r - s - 1) % world it receives; after world - 1 steps it holds the finished piece "
        "(r + 1) % world, which the all-gather passes on. Note that tensor.chunk(n) can return "
        "fewer than n pieces; tensor_split(n) always returns n",
    )


EXERCISE = Exercise(
    key="ring_average",
    name="ring_average",
    functions=("ring_average",),
    world_size=3,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.ring_average,),
    hang_hint="every rank waits for a message that its neighbour never sends: check that each "
    "send has a matching recv on the neighbour, and send with dist.isend (if every rank "
    "first sends with a blocking send, all of them can wait at once)",
    raise_hints={
        "IndexError": "tensor.chunk(n) returns fewer than n pieces when the tensor is "
        "short (4 rows in 3 chunks: 2 pieces of 2); tensor.view(-1).tensor_split(n) always "
        "returns n, some of them empty",
    },
)
