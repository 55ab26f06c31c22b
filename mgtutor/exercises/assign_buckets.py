"""Notebook 07's exercise: DDP's gradient buckets, checked against the ones DDP builds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_buckets", "run"]

CASES = (  # label, width, depth, bucket_cap_mb
    ("mlp(width=300, depth=4), bucket_cap_mb unset: about 1 MiB first, then 25 MiB", 300, 4, None),
    ("mlp(width=300, depth=4), bucket_cap_mb=0.5", 300, 4, 0.5),
    ("mlp(width=64, depth=6), bucket_cap_mb=0.02", 64, 6, 0.02),
)


def check_buckets(assign_buckets: Callable[..., Any], *, timeout: float = 30.0) -> CheckResult:
    """Check a reconstruction of the buckets DDP builds for its gradient all-reduces.

    The exercise: write ``assign_buckets(param_sizes_bytes, cap_bytes, first_cap_bytes) ->
    list[list[int]]``. ``param_sizes_bytes`` holds each parameter's size in bytes, in
    ``model.parameters()`` order. Return DDP's buckets in the order it reduces them, each a
    list of parameter indices: the parameters taken from the last to the first (the order their
    gradients become ready in backward), a bucket closed once it holds at least its cap,
    ``first_cap_bytes`` for the first bucket and ``cap_bytes`` for the later ones.

    The checker builds DDP on 2 ranks for three MLPs and caps, runs three steps (DDP rebuilds
    its buckets in the second forward, in the order the first backward's gradients arrived,
    which for these MLPs is the reverse of ``model.parameters()``) and compares with the
    buckets DDP reports in its logging data (``rebuilt_per_bucket_param_indices``).

    Args:
        assign_buckets: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``assign_buckets`` is not a function.
    """
    return check(EXERCISE, (assign_buckets,), timeout)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    from mgtutor.models import mlp

    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, width, depth, cap_mb in CASES:
        torch.manual_seed(0)
        module, x = mlp(width=width, depth=depth), torch.randn(4, width)
        model = DDP(module, bucket_cap_mb=cap_mb)
        # DDP rebuilds its buckets in the second forward, in the order the first backward's
        # gradients arrived; its logging data reports them from the third forward on.
        for _ in range(3):
            model(x).sum().backward()
        data = model._get_ddp_logging_data()
        real = [
            [int(i) for i in b.split()] for b in data["rebuilt_per_bucket_param_indices"].split(",")
        ]
        cap = int(data["bucket_cap_bytes"])
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap
        sizes = [p.numel() * p.element_size() for p in module.parameters()]
        returned = call_learner(index, case, fn, list(sizes), cap, first)
        findings.append(_diagnose_buckets(case, returned, real, sizes, cap, first))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _greedy(
    order: list[int], sizes: list[int], limits: list[int], *, spill: bool
) -> list[list[int]]:
    """Buckets of ``order``; spill: a parameter that would pass the limit opens the next one."""
    buckets: list[list[int]] = [[]]
    total = 0
    for i in order:
        limit = limits[min(len(buckets) - 1, len(limits) - 1)]
        if spill and buckets[-1] and total + sizes[i] > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += sizes[i]
        if not spill and total >= limit:
            buckets.append([])
            total = 0
    return [b for b in buckets if b]


def _diagnose_buckets(
    case: str, returned: Any, real: list[list[int]], sizes: list[int], cap: int, first: int
) -> Finding:
    try:
        got = [[int(i) for i in bucket] for bucket in returned]
    except (TypeError, ValueError):
        return make_finding(
            case,
            f"returned {type(returned).__name__} {returned!r:.80}",
            "return a list of buckets, each a list of parameter indices (into param_sizes_bytes)",
        )
    if got == real:
        return make_finding(case)
    backward = list(reversed(range(len(sizes))))
    forward = list(range(len(sizes)))
    wrong = {
        "the parameters in their forward order": (
            _greedy(forward, sizes, [first, cap], spill=False),
            "gradients become ready in backward, from the last layer to the first: go through "
            "the parameters in reverse",
        ),
        "a parameter that would pass the cap moved to the next bucket": (
            _greedy(backward, sizes, [first, cap], spill=True),
            "DDP adds the parameter first and closes the bucket once it holds at least the "
            "cap: a bucket can end larger than its cap",
        ),
        "every bucket capped at cap_bytes": (
            _greedy(backward, sizes, [cap], spill=False),
            "only the later buckets take cap_bytes: the first one closes at first_cap_bytes",
        ),
        "every bucket capped at first_cap_bytes": (
            _greedy(backward, sizes, [first], spill=False),
            "only the first bucket closes at first_cap_bytes; the later ones at cap_bytes",
        ),
        "the buckets in reverse": (
            real[::-1],
            "the bucket holding the last layer's gradients comes first: it is reduced first",
        ),
    }
    detail = f"returned {got}, expected {real}"
    for name, (value, hint) in wrong.items():
        if got == value:
            return make_finding(case, f"{detail}: that is {name}", hint)
    return make_finding(
        case,
        detail,
        "walk the parameters from the last to the first, add each to the open bucket, and "
        "close it when it holds at least its cap (first_cap_bytes for the first, cap_bytes after)",
    )


EXERCISE = Exercise(
    key="assign_buckets",
    name="assign_buckets",
    functions=("assign_buckets",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.assign_buckets,),
    hang_hint="the function does not return: it needs no collective, only one pass over the sizes",
)
