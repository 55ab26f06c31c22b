"""Notebook 16's exercise: plan the dispatch of a mixture of experts' tokens to their ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import Finding, call_learner, everyone_ok, make_finding

__all__ = ["CASES", "EXERCISE", "check_expert_dispatch", "run"]

CASES = (  # label, capacity factor, whether rank 1's experts are chosen by no token
    ("24 tokens per rank, top-2 of 4 experts, 2 per rank, no capacity", None, False),
    ("capacity factor 1.0: dropped assignments are not sent", 1.0, False),
    ("no token chooses rank 1's experts: send is [n, 0]", None, True),
)
_DIM, _HIDDEN, _EXPERTS, _K, _TOKENS = 8, 16, 4, 2, 24


def check_expert_dispatch(
    plan_dispatch: Callable[..., Any], *, timeout: float = 30.0
) -> CheckResult:
    """Check the dispatch plan of a mixture of experts whose experts are spread across ranks.

    The exercise: write ``plan_dispatch(experts, keep, experts_per_rank, world) -> (order,
    per_expert, send)``. ``experts`` ``[tokens, k]`` holds each token's chosen experts, ``keep``
    (same shape) whether each assignment fits in its expert's capacity. Return the kept
    assignments' flat indices (``token * k + choice``) sorted by expert, the number for each
    expert, and the rows for each rank (the ``input_split_sizes`` of ``all_to_all_single``).

    The checker runs it on 2 ranks (4 experts, 2 each) inside
    :class:`mgtutor.parallel.expert.ExpertParallelMoE`, with no capacity, with capacity factor
    1.0, and with no token choosing rank 1's experts, against one process. It recognizes counts
    per expert where counts per rank belong, splits in reverse rank order, assignments not
    grouped by expert, dropped assignments sent, and ``bincount`` without ``minlength``.

    Args:
        plan_dispatch: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``plan_dispatch`` is not a function.
    """
    return check(EXERCISE, (plan_dispatch,), timeout)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, factor, starved) in enumerate(CASES):
        findings.append(_one_case(index, number, case, factor, starved, fn))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _model(number: int, factor: float | None, starved: bool) -> tuple[Any, torch.Tensor]:
    from mgtutor.parallel.expert import MoE

    torch.manual_seed(number)
    moe = MoE(_DIM, _HIDDEN, _EXPERTS, _K, factor).double()
    x = torch.randn(dist.get_world_size() * _TOKENS, _DIM, dtype=torch.float64)
    if starved:  # feature 0 is large on every token and scores only experts 0 and 1
        x[:, 0] = 10.0
        with torch.no_grad():
            moe.router.weight[:, 0] = torch.tensor([5.0, 5.0, -5.0, -5.0])
    return moe, x


def _one_case(
    index: int, number: int, case: str, factor: float | None, starved: bool, fn: Any
) -> Finding:
    from mgtutor.parallel.expert import ExpertParallelMoE

    rank, world = dist.get_rank(), dist.get_world_size()
    moe, x = _model(number, factor, starved)
    mine = slice(rank * _TOKENS, (rank + 1) * _TOKENS)
    r = moe.route(x[mine])
    experts, keep = r["experts"].clone(), r["keep"].clone()
    returned = call_learner(index, case, fn, experts, keep, _EXPERTS // world, world)
    finding = _diagnose_plan(case, returned, r["experts"], r["keep"], world)
    if not everyone_ok(finding):  # a wrong split would make the all-to-all fail or hang
        return finding

    x.requires_grad_()
    y, aux = moe(x, groups=world)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    ((y * grad_y).sum() + aux).backward()
    ep = ExpertParallelMoE(moe, plan=lambda *args: call_learner(index, case, fn, *args))
    x_mine = x.detach()[mine].clone().requires_grad_()
    y_mine, aux_mine = ep(x_mine)
    ((y_mine * grad_y[mine]).sum() + aux_mine / world).backward()
    # Both reach the loss through mgtutor's own layers: the plan only picks rows.
    assert x.grad is not None and x_mine.grad is not None
    for what, got, want in (
        ("output", y_mine, y[mine]),
        ("input's gradient", x_mine.grad, x.grad[mine]),
    ):
        if torch.allclose(got, want.detach()):
            continue
        return make_finding(
            case,
            f"rank {rank}: the layer's {what} with your plan differs from one process by up to "
            f"{(got - want.detach()).abs().max().item():.3g}",
            "order, per_expert and send must describe the same rows: order's blocks in expert "
            "order, per_expert[e] rows for expert e, send[r] the sum over rank r's experts",
        )
    return make_finding(case)


def _diagnose_plan(
    case: str, returned: Any, experts: torch.Tensor, keep: torch.Tensor, world: int
) -> Finding:
    from mgtutor.parallel.expert import plan_dispatch

    rank = dist.get_rank()
    per_rank = _EXPERTS // world
    want_order, want_per_expert, want_send = plan_dispatch(experts, keep, per_rank, world)
    if not (isinstance(returned, (tuple, list)) and len(returned) == 3):
        return make_finding(
            case,
            f"rank {rank}: returned {type(returned).__name__} {returned!r:.60}",
            "return three things: (order, per_expert, send)",
        )
    order, per_expert, send = returned
    try:
        send = [int(n) for n in send]
        per_expert = [int(n) for n in per_expert]
        order = torch.as_tensor(order, dtype=torch.long).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        return make_finding(
            case,
            f"rank {rank}: could not read the plan as integers ({exc})",
            "order: a tensor of indices; per_expert and send: lists or tensors of counts",
        )
    flat = experts.reshape(-1)
    if len(send) == _EXPERTS != world:
        return make_finding(
            case,
            f"rank {rank}: send has {len(send)} counts, one per expert; all_to_all_single "
            f"needs {world}, one per rank",
            "sum per_expert over each rank's experts: rank r holds experts "
            "r * experts_per_rank to (r + 1) * experts_per_rank - 1",
        )
    if len(per_expert) != _EXPERTS:
        return make_finding(
            case,
            f"rank {rank}: per_expert has {len(per_expert)} counts, expected {_EXPERTS}, one "
            f"per expert (the last experts got no token here)",
            "torch.bincount(..., minlength=experts_per_rank * world): without minlength an "
            "expert no token chose at the end is left out",
        )
    if len(send) != world:
        return make_finding(
            case, f"rank {rank}: send has {len(send)} counts, expected {world}, one per rank", ""
        )
    kept = keep.reshape(-1).nonzero().squeeze(1)
    if sorted(order.tolist()) != kept.tolist():
        if sorted(order.tolist()) == list(range(flat.numel())) and len(kept) < flat.numel():
            return make_finding(
                case,
                f"rank {rank}: order includes the {flat.numel() - len(kept)} assignments that "
                f"keep marks as dropped",
                "send only the kept assignments: keep.reshape(-1).nonzero()",
            )
        return make_finding(
            case,
            f"rank {rank}: order is not each kept assignment once (token * k + choice)",
            "order holds the flat indices of the kept assignments, each exactly once",
        )
    destination = flat[order]
    if not bool((destination[1:] >= destination[:-1]).all()):
        grouped_by_rank = bool(((destination // per_rank).diff() >= 0).all())
        return make_finding(
            case,
            f"rank {rank}: order's assignments are not grouped by expert"
            + (" (by rank, but mixed within a rank)" if grouped_by_rank else ""),
            "all_to_all_single sends consecutive blocks: sort by expert (torch.argsort of "
            "the experts of the kept assignments), so each rank's block is its experts' rows, "
            "the first expert's before the second's",
        )
    if per_expert != want_per_expert.tolist():
        return make_finding(
            case,
            f"rank {rank}: per_expert is {per_expert}, expected {want_per_expert.tolist()}",
            "count the kept assignments of each expert (dropped ones are not sent)",
        )
    if send != want_send:
        if send == want_send[::-1]:
            detail = f"rank {rank}: send is {send}, the counts in reverse rank order"
        elif sum(send) == flat.numel() != sum(want_send):
            detail = f"rank {rank}: send is {send}, which counts the dropped assignments"
        else:
            detail = f"rank {rank}: send is {send}, expected {want_send}"
        return make_finding(
            case,
            detail,
            "send[r] is the number of rows for rank r, rank 0 first: the sum of per_expert "
            "over rank r's experts",
        )
    return make_finding(case)


EXERCISE = Exercise(
    key="expert_dispatch",
    name="plan_dispatch",
    functions=("plan_dispatch",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.plan_dispatch,),
    hang_hint="the function does not return: it needs no collective and no loop over ranks, a "
    "sort and two counts of the router's choices",
)
