"""Notebook 11's exercise: which ranks' replicas have drifted from rank 0's, told to every rank."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from mgtutor.exercises.cases._common import (
    Finding,
    _call,
    _everyone_ok,
    _finding,
)

__all__ = ["DRIFT_CASES", "run"]

ATOL = 1e-6  # the tolerance the exercise states


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


DRIFT_CASES: tuple[tuple[str, Callable[[torch.nn.Module, int], None], list[int]], ...] = (
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
    for case, change, truth in DRIFT_CASES:
        model = _replica(change, rank)
        before = [p.detach().clone() for p in model.parameters()]
        returned = _call(index, case, fn, model)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, _as_ranks(returned))
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        findings.append(_diagnose_drift(case, everyone, truth, rank, changed))
        if not _everyone_ok(findings[-1]):
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
        return _finding(
            case,
            "the model's parameters changed during the call",
            "find the drift without repairing it: dist.broadcast writes rank 0's values into "
            "the tensor it gets, so broadcast into a copy (p.detach().clone()), never into the "
            "parameter itself",
        )
    if mine == truth:
        return _finding(case)
    detail = f"returned {mine}, expected {truth}"
    if isinstance(mine, str):
        right_on_0 = everyone[0] == truth
        return _finding(
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
        return _finding(
            case,
            f"{detail}: each rank reported only itself",
            "each rank found out about itself only: share the verdicts (one all_reduce of a "
            "0/1 flag per rank, or all_gather_object) so that every rank returns the same list",
        )
    if 0 in mine:
        return _finding(
            case,
            f"{detail}: rank 0 is in the list",
            "rank 0 is the reference (DDP copied its parameters to the others at the start, and "
            "a resync copies them again), not the majority or the mean: compare every rank with "
            "rank 0's parameters",
        )
    if not truth:
        return _finding(
            case,
            f"{detail}: the differences here are at most 6e-08, within the tolerance {ATOL:g}",
            "compare with a tolerance, torch.allclose(p, p0, rtol=0, atol=atol), not with ==: "
            "replicas of one job can differ in the last bits (another GPU model, another order "
            "of summing) without having drifted",
        )
    if case.startswith("rank 1 swapped"):
        return _finding(
            case,
            f"{detail}: rank 1's parameters have rank 0's sum and norm, in another order",
            "a checksum (a sum, a norm) hides changes that cancel out; compare element by "
            "element with rank 0's parameters, broadcast from rank 0 into a copy",
        )
    return _finding(
        case,
        detail,
        "broadcast rank 0's parameters (into a copy), compare each rank's with them, and share "
        "the verdicts so that every rank returns the same list",
    )
