"""Notebook 03's exercise: an exact accuracy that leaves out DistributedSampler's padded repeats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    as_number,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_exact_accuracy", "run"]

# On 3 ranks, as 2 ranks never have more than one repeat (always the last rank's last index), so
# no 2-rank case tells the recipe from a shortcut that drops that one entry.
CASES = (  # label, samples, shuffle, drop_last
    ("10 samples, shuffle=False: 2 repeats, on ranks 1 and 2", 10, False, False),
    ("13 samples, shuffle=True: 2 repeats, on ranks 1 and 2", 13, True, False),
    ("11 samples, shuffle=True: 1 repeat, on rank 2", 11, True, False),
    ("12 samples: no repeat", 12, True, False),
    ("1 sample on 3 ranks: ranks 1 and 2 hold only repeats", 1, False, False),
    ("11 samples, drop_last=True: 2 left out, none repeated", 11, True, True),
)


def check_exact_accuracy(
    exact_accuracy: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check an exact distributed accuracy that does not count the sampler's padded repeats.

    The exercise: write ``exact_accuracy(correct, sampler) -> float``. ``sampler`` is this
    rank's ``DistributedSampler`` (padded, as by default, or with ``drop_last=True``;
    shuffled or not), and ``correct`` a bool tensor with one entry per index it gives this
    rank, in its order: whether the model got that sample right. Return, on every rank, the
    accuracy over the samples the sampler hands out, each counted once.

    The checker runs it on 3 ranks, with datasets that put repeats on one rank, on two and on
    none, one where two ranks hold nothing but repeats, and ``drop_last=True``.

    Args:
        exact_accuracy: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``exact_accuracy`` is not a function.
    """
    return check(EXERCISE, (exact_accuracy,), timeout)


def _sampler(
    n: int, shuffle: bool, drop_last: bool, world: int | None = None, rank: int | None = None
) -> DistributedSampler[int]:
    """A DistributedSampler over ``n`` samples, seed 0 (it reads only their number)."""
    # torch annotates the dataset as a Dataset; the sampler needs only len() of it.
    data = range(n)
    return DistributedSampler(
        data,  # type: ignore[arg-type]
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=0,
        drop_last=drop_last,
    )


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, n, shuffle, drop_last in CASES:
        shards = [list(_sampler(n, shuffle, drop_last, world, r)) for r in range(world)]
        padded = [shards[p % world][p // world] for p in range(world * len(shards[0]))]
        truth = torch.tensor([i % 3 == 0 for i in range(n)])  # the figures below all differ
        truth[padded[n:]] = True  # the repeats are right: counting them raises the accuracy
        sampler = _sampler(n, shuffle, drop_last)
        got = call_learner(index, case, fn, truth[list(sampler)].clone(), sampler)
        findings.append(_diagnose_accuracy(case, got, truth, shards, padded, n, rank))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_accuracy(
    case: str,
    got: Any,
    truth: torch.Tensor,
    shards: list[list[int]],
    padded: list[int],
    n: int,
    rank: int,
) -> Finding:
    value = as_number(
        case, got, "return one number, the same on every rank (a Python float, or tensor.item())"
    )
    if isinstance(value, dict):
        return value
    world = len(shards)
    seen = sorted(set(padded))  # every index handed out, once
    correct = int(truth[seen].sum())
    exact = correct / len(seen)
    # float32 counts are exact; only the final division may round (about 1e-8). Miscounts on
    # these few samples are off by far more.
    if abs(value - exact) < 1e-6:
        return make_finding(case)
    # Rank r's i-th index sits at position r + i * world of the padded order; from n on: repeats.
    real = [[i for p, i in enumerate(shard) if r + p * world < n] for r, shard in enumerate(shards)]
    padded_correct = int(truth[padded].sum())
    candidates = {
        "repeats": padded_correct / len(padded),
        "repeats over the true count": padded_correct / len(seen),
        "own shard": float(truth[shards[rank]].float().mean()),
    }
    if all(real):
        candidates["mean of means"] = sum(float(truth[s].float().mean()) for s in real) / world
        candidates["own real shard"] = float(truth[real[rank]].float().mean())
    match = next((k for k, v in candidates.items() if abs(value - v) < 1e-6), None)
    detail = f"returned {value:.6f}, expected {exact:.6f} ({correct} right of {len(seen)})"
    hints = {
        "repeats": "that counts the sampler's padded repeats: of rank r's indices, the i-th "
        "sits at position r + i * num_replicas of the padded order, and the positions from "
        "len(sampler.dataset) on are repeats; leave them out of both counts",
        "repeats over the true count": "the correct count includes the padded repeats: "
        "leave out the positions from len(sampler.dataset) on before summing",
        "own shard": "that is this rank's own figure: sum the correct count and the sample "
        "count over all ranks (one all_reduce, or mgtutor.reduce_sums) and divide the sums",
        "own real shard": "that is this rank's own figure: sum the correct count and the "
        "sample count over all ranks (one all_reduce, or mgtutor.reduce_sums)",
        "mean of means": "that is the mean of the ranks' accuracies; the ranks hold different "
        "numbers of real samples, so sum the counts over the ranks and divide once",
    }
    if match is not None:
        return make_finding(case, f"{detail}; that is {match!r}", hints[match])
    return make_finding(
        case, detail, "count each index the sampler hands out once, over all ranks, and divide"
    )


EXERCISE = Exercise(
    key="exact_accuracy",
    name="exact_accuracy",
    functions=("exact_accuracy",),
    world_size=3,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.exact_accuracy,),
    hang_hint="a collective that not every rank calls waits forever: call it on every rank, even "
    "one with no real sample, outside any if-block",
    raise_hints={
        "ZeroDivisionError": "a rank can hold no real sample at all (1 sample on 3 ranks): "
        "sum the correct and the sample counts over the ranks first, then divide once",
    },
)
