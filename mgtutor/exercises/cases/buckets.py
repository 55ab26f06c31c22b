"""Notebook 07's exercise: DDP's gradient buckets, checked against the ones DDP builds."""

from __future__ import annotations

from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutor.exercises.cases._common import (
    Finding,
    _call,
    _everyone_ok,
    _finding,
)

__all__ = ["BUCKET_CASES", "run"]

BUCKET_CASES = (  # label, width, depth, bucket_cap_mb
    ("mlp(width=300, depth=4), bucket_cap_mb unset: about 1 MiB first, then 25 MiB", 300, 4, None),
    ("mlp(width=300, depth=4), bucket_cap_mb=0.5", 300, 4, 0.5),
    ("mlp(width=64, depth=6), bucket_cap_mb=0.02", 64, 6, 0.02),
)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    from mgtutor.models import mlp

    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, width, depth, cap_mb in BUCKET_CASES:
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
        returned = _call(index, case, fn, list(sizes), cap, first)
        findings.append(_diagnose_buckets(case, returned, real, sizes, cap, first))
        if not _everyone_ok(findings[-1]):
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
        return _finding(
            case,
            f"returned {type(returned).__name__} {returned!r:.80}",
            "return a list of buckets, each a list of parameter indices (into param_sizes_bytes)",
        )
    if got == real:
        return _finding(case)
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
            return _finding(case, f"{detail}: that is {name}", hint)
    return _finding(
        case,
        detail,
        "walk the parameters from the last to the first, add each to the open bucket, and "
        "close it when it holds at least its cap (first_cap_bytes for the first, cap_bytes after)",
    )
