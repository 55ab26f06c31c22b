"""Notebook 11's exercise: which ranks' replicas have drifted from rank 0's, told to every rank."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_find_drifted", "run"]

ATOL = 1e-6  # the tolerance the exercise states


def check_find_drifted(find_drifted: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check a detector of replicas that drifted from rank 0's, as in notebook 11's section 4.

    The exercise: write ``find_drifted(model, atol=1e-6) -> list[int]``. It is called on every
    rank with that rank's replica and returns, on every rank, the sorted list of the ranks whose
    parameters differ from rank 0's by more than ``atol`` in some element (rank 0 never is in
    it), without changing the model.

    The checker runs it on 3 ranks, each with notebook 11's small model changed on some
    ranks: none, one weight on rank 2, rank 1's last bits (within the tolerance), two weights
    swapped on rank 1 (a checksum cannot see it) and a bias on rank 0.

    Args:
        find_drifted: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``find_drifted`` is not a function.
    """
    return check(EXERCISE, (find_drifted,), timeout)


def _nudge_rank_2(model: torch.nn.Module, rank: int) -> None:
    if rank == 2:
        next(model.parameters())[0, 0] += 0.01


def _last_bit_on_rank_1(model: torch.nn.Module, rank: int) -> None:
    if rank == 1:
        bias = list(model.parameters())[-1]
        bias.copy_(torch.nextafter(bias, torch.full_like(bias, float("inf"))))


def _swap_on_rank_1(model: torch.nn.Module, rank: int) -> None:
    if rank == 1:
        weight = next(model.parameters())
        weight[0, 0], weight[0, 1] = weight[0, 1].clone(), weight[0, 0].clone()


def _nudge_rank_0(model: torch.nn.Module, rank: int) -> None:
    if rank == 0:
        list(model.parameters())[-1][0] += 0.01


CASES: tuple[tuple[str, Callable[[torch.nn.Module, int], None], list[int]], ...] = (
    ("the 3 replicas agree", lambda model, rank: None, []),
    ("rank 2 changed one weight by 0.01, outside the optimizer", _nudge_rank_2, [2]),
    ("rank 1's last bias differs in the last bit (6e-08 at most)", _last_bit_on_rank_1, []),
    ("rank 1 swapped two weights: the same sum, the same norm", _swap_on_rank_1, [1]),
    ("rank 0 changed one bias by 0.01: ranks 1 and 2 differ from it", _nudge_rank_0, [1, 2]),
)


def _replica(change: Callable[[torch.nn.Module, int], None], rank: int) -> torch.nn.Module:
    torch.manual_seed(0)  # notebook 11's model, the same on every rank before the change
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        change(model, rank)
    return model


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, change, truth in CASES:
        model = _replica(change, rank)
        before = [p.detach().clone() for p in model.parameters()]
        returned = call_learner(index, case, fn, model)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, _as_ranks(returned))
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        findings.append(_diagnose_drift(case, everyone, truth, rank, changed))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _as_ranks(returned: Any) -> list[int] | str:
    if returned is None:
        return "None"
    try:
        return sorted(operator.index(r) for r in returned)
    except TypeError:
        return f"{type(returned).__name__} {returned!r:.60}"


def _diagnose_drift(
    case: str, everyone: list, truth: list[int], rank: int, changed: bool
) -> Finding:
    mine = everyone[rank]
    if changed:
        return make_finding(
            case,
            "the model's parameters changed during the call",
            "find the drift without repairing it: dist.broadcast writes rank 0's values into "
            "the tensor it gets, so broadcast into a copy (p.detach().clone()), never into the "
            "parameter itself",
        )
    if mine == truth:
        return make_finding(case)
    detail = f"returned {mine}, expected {truth}"
    if isinstance(mine, str):
        right_on_0 = everyone[0] == truth
        return make_finding(
            case,
            detail + (" (rank 0 returned the right list)" if right_on_0 else ""),
            "every rank must return the list, not only rank 0: every rank then takes the same "
            "decision (say, all call the broadcast that repairs the drift)"
            if right_on_0
            else "return a list of rank numbers, the same list on every rank",
            knock_on=not right_on_0,
        )
    world = len(everyone)
    if all(everyone[r] == ([r] if r in truth else []) for r in range(world)):
        return make_finding(
            case,
            f"{detail}: each rank reported only itself",
            "each rank found out about itself only: share the verdicts (one all_reduce of a "
            "0/1 flag per rank, or all_gather_object) so that every rank returns the same list",
        )
    if 0 in mine:
        return make_finding(
            case,
            f"{detail}: rank 0 is in the list",
            "rank 0 is the reference (DDP copied its parameters to the others at the start, and "
            "a resync copies them again), not the majority or the mean: compare every rank with "
            "rank 0's parameters",
        )
    if not truth:
        return make_finding(
            case,
            f"{detail}: the differences here are at most 6e-08, within the tolerance {ATOL:g}",
            "compare with a tolerance, torch.allclose(p, p0, rtol=0, atol=atol), not with ==: "
            "replicas of one job can differ in the last bits (another GPU model, another order "
            "of summing) without having drifted",
        )
    if case.startswith("rank 1 swapped"):
        return make_finding(
            case,
            f"{detail}: rank 1's parameters have rank 0's sum and norm, in another order",
            "a checksum (a sum, a norm) hides changes that cancel out; compare element by "
            "element with rank 0's parameters, broadcast from rank 0 into a copy",
        )
    return make_finding(
        case,
        detail,
        "broadcast rank 0's parameters (into a copy), compare each rank's with them, and share "
        "the verdicts so that every rank returns the same list",
    )


EXERCISE = Exercise(
    key="find_drifted",
    name="find_drifted",
    functions=("find_drifted",),
    world_size=3,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.find_drifted,),
    hang_hint="a collective that not every rank calls waits forever: call the same collectives on "
    "every rank, rank 0 included, whatever its own verdict",
)
