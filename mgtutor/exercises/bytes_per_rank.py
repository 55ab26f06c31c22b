"""Notebook 12's exercise: the bytes each rank holds under DDP, ZeRO-1 and FSDP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_bytes_per_rank", "run"]

CASES = (  # label, parameters, ranks, strategy
    ("1,000 parameters, 4 ranks, ddp", 1000, 4, "ddp"),
    ("1,000 parameters, 4 ranks, zero1", 1000, 4, "zero1"),
    ("1,001 parameters, 4 ranks, zero1", 1001, 4, "zero1"),
    ("10 parameters, 4 ranks, fsdp", 10, 4, "fsdp"),
    ("6 parameters, 8 ranks, fsdp", 6, 8, "fsdp"),
    ("7 billion parameters, 64 ranks, fsdp", 7_000_000_000, 64, "fsdp"),
)


def check_bytes_per_rank(
    bytes_per_rank: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check a memory calculator for Adam in float32 under DDP, ZeRO-1 and FSDP.

    The exercise: write ``bytes_per_rank(n_params, world_size, strategy) -> list[int]``: for a
    model whose parameters are one 1-d float32 tensor of ``n_params`` elements, trained with
    Adam, the bytes each rank holds for parameters (4 per element), gradients (4) and Adam's
    two moments (8), in rank order, under ``"ddp"``, ``"zero1"`` (the best case of
    ``ZeroRedundancyOptimizer``: Adam's state split evenly by element, the first
    ``n_params % world_size`` ranks one more, as :func:`mgtutor.plan.memplan.estimate`
    assumes for a count) and ``"fsdp"`` (``fully_shard``: ``torch.chunk`` shards padded to the
    first one's size). DDP's buckets, Adam's step counters and activations are left out.

    The checker compares with :func:`mgtutor.plan.memplan.estimate` on six
    cases, one of them with more ranks than some shards have elements.

    Args:
        bytes_per_rank: your function.
        timeout: seconds the rank may take before it is stopped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``bytes_per_rank`` is not a function.
    """
    return check(EXERCISE, (bytes_per_rank,), timeout)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    from mgtutor.plan.memplan import estimate

    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, n, world, strategy in CASES:
        truth = [
            b.parameters + b.gradients + b.optimizer_state
            for b in estimate(n, world_size=world, strategy=strategy, optimizer="adam")
        ]
        returned = call_learner(index, case, fn, n, world, strategy)
        findings.append(_diagnose_bytes(case, returned, truth, n, world, strategy))
        if not findings[-1]["ok"]:
            break
    return findings


def _diagnose_bytes(
    case: str, returned: Any, truth: list[int], n: int, world: int, strategy: str
) -> Finding:
    if not isinstance(returned, (list, tuple)) or len(returned) != world:
        return make_finding(
            case,
            f"returned {type(returned).__name__} {returned!r:.80}",
            f"return a list of {world} numbers, the bytes each rank holds, in rank order: "
            "the ranks do not all hold the same",
        )
    if list(returned) == truth:
        return make_finding(case)
    shard, padded = n // world, -(-n // world)
    held = [max(0, min(padded, n - r * padded)) for r in range(world)]
    share = [shard + (r < n % world) for r in range(world)]
    if strategy == "ddp":
        wrong = {
            "DDP's buckets counted too": (
                [20 * n] * world,
                "leave out DDP's gradient buckets: count parameters (4 B), gradients (4 B) "
                "and Adam's two moments (8 B) per parameter",
            ),
            "DDP sharding everything": (
                [16 * n / world] * world,
                "DDP shards nothing: every rank holds all parameters, gradients and Adam state",
            ),
        }
    else:
        wrong = {
            "DDP's figure, nothing sharded": (
                [16 * n] * world,
                f"{strategy} shards the optimizer state"
                + (" and the parameters and gradients" if strategy == "fsdp" else "")
                + " across the ranks",
            )
        }
    if strategy == "zero1":
        wrong["ZeRO-1 sharding parameters and gradients too"] = (
            [16 * s for s in share],
            "ZeRO-1 shards only the optimizer state; every rank keeps all parameters and all "
            "gradients (sharding those is ZeRO-2 and ZeRO-3, FSDP)",
        )
        wrong["a fractional share"] = (
            [8 * n + 8 * n / world] * world,
            "a rank holds whole elements: with a count, the first n % world_size ranks update "
            "one element more (n // world_size + 1)",
        )
        wrong["every rank rounding its share down"] = (
            [8 * n + 8 * shard] * world,
            "the n % world_size elements left over also belong to some rank: the first ones "
            "take one more each",
        )
    if strategy == "fsdp":
        wrong["the unpadded shards"] = (
            [16 * h for h in held],
            "fully_shard pads every rank's parameter and gradient shard to ceil(n / world_size) "
            "elements, even the ranks whose real rows run out",
        )
        wrong["the padded shards for Adam's state too"] = (
            [16 * padded] * world,
            "Adam's state is made with zeros_like of the rank's real (unpadded) shard: 8 bytes "
            "per element the rank really holds, ceil(n / world_size) at most, fewer at the end",
        )
        wrong["shards of n // world_size"] = (
            [16 * shard] * world,
            "the shards are torch.chunk's: ceil(n / world_size) elements each, the last ranks "
            "holding fewer real ones (or none) and padding up to that size",
        )
        wrong["shards of n / world_size"] = (
            [16 * n / world] * world,
            "elements are not split: the shards are torch.chunk's, ceil(n / world_size) each",
        )
        wrong["ZeRO-1's figure"] = (
            [8 * n + 8 * s for s in share],
            "FSDP shards the parameters and the gradients too, not only the optimizer state",
        )
    detail = f"returned {list(returned)}, expected {truth}"
    for name, (values, hint) in wrong.items():
        if list(returned) == values:
            return make_finding(case, f"{detail}: that is {name}", hint)
    return make_finding(
        case,
        detail,
        "per parameter element: 4 B of parameter, 4 B of gradient, 8 B of Adam state, each "
        "counted on the ranks that hold it",
    )


EXERCISE = Exercise(
    key="bytes_per_rank",
    name="bytes_per_rank",
    functions=("bytes_per_rank",),
    world_size=1,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.bytes_per_rank,),
    hang_hint="the function does not return: it computes a few numbers, with no collective and "
    "no loop over the parameters",
)
