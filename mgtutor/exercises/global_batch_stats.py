"""Notebook 04's exercise: the global batch's mean and biased variance, as SyncBatchNorm needs."""

from __future__ import annotations

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

__all__ = ["CASES", "EXERCISE", "check_global_batch_stats", "run"]

CASES = (  # label, samples on each rank, one sample's shape (C, ...)
    ("4 and 4 samples of 3 features, (N, 3)", (4, 4), (3,)),
    ("6 and 2 images, (N, 2, 3, 3)", (6, 2), (2, 3, 3)),
    ("5 samples and 1 sample of 4 features, (N, 4)", (5, 1), (4,)),
)


def check_global_batch_stats(
    global_batch_stats: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check the per-channel statistics SyncBatchNorm normalizes with, over the global batch.

    The exercise: write ``global_batch_stats(x) -> (mean, var)``. ``x`` is this rank's part of
    the batch, ``(N, C)`` or ``(N, C, H, W)``; N may differ between ranks (and be 1). Return, on
    every rank, two tensors of shape ``(C,)``: each channel's mean and biased variance (divided
    by the count, as BatchNorm normalizes) over every value of the global batch, all ranks'
    samples together.

    The checker runs it on 2 ranks with equal batches, uneven ones and a rank holding a single
    sample, and compares with ``torch.var_mean`` over the ranks' inputs concatenated.

    Args:
        global_batch_stats: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``global_batch_stats`` is not a function.
    """
    return check(EXERCISE, (global_batch_stats,), timeout)


def _stats_input(case: int, rank: int, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * case + rank)
    x = torch.randn(n, *shape, generator=generator) * (1 + rank)  # the ranks' spreads differ
    offset = torch.arange(shape[0], dtype=torch.float32).view(1, -1, *([1] * (len(shape) - 1)))
    return x + 3 * rank + offset  # and so do their means


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and biased variance (torch.var_mean), and the values per channel."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)
    return mean, var, x.numel() // x.shape[1]


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank = dist.get_rank()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, counts, shape) in enumerate(CASES):
        inputs = [_stats_input(number, r, n, shape) for r, n in enumerate(counts)]
        x = inputs[rank].clone()
        returned = call_learner(index, case, fn, x)
        findings.append(_diagnose_batch_stats(case, returned, inputs, rank))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_batch_stats(
    case: str, returned: Any, inputs: list[torch.Tensor], rank: int
) -> Finding:
    channels = inputs[0].shape[1]
    mean, var, total = _channel_stats(torch.cat(inputs))
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        return make_finding(
            case,
            f"returned {type(returned).__name__} {returned!r:.80}",
            f"return a pair (mean, var), each a tensor of {channels} values, one per channel",
        )
    got = []
    for what, value in zip(("mean", "var"), returned):
        if not isinstance(value, torch.Tensor) or value.shape != (channels,):
            shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return make_finding(
                case,
                f"the {what} returned is {shown}, not a tensor of shape ({channels},)",
                "reduce over every dimension but the channels' (dim 1): x.sum(dim=[0, 2, 3]) "
                "for (N, C, H, W), x.sum(dim=0) for (N, C)",
            )
        got.append(value.detach().double())
    stats = [_channel_stats(x) for x in inputs]
    n = torch.tensor([float(s[2]) for s in stats], dtype=torch.float64)
    means = torch.stack([s[0] for s in stats])
    variances = torch.stack([s[1] for s in stats])
    own_n = n[rank]
    sums, squares = (means * n[:, None]).sum(0), ((variances + means**2) * n[:, None]).sum(0)
    forgot_mean = sums / (own_n * len(inputs))
    wrong_means = {
        "this rank's own mean": (
            means[rank],
            "that is this rank's own statistic: combine the ranks' sums with an all_reduce",
        ),
        "the mean of the ranks' means": (
            means.mean(0),
            "the ranks hold different numbers of samples, so their means do not weigh the same: "
            "all-reduce the sums and the counts, and divide the global sum by the global count",
        ),
        "the global sum over this rank's count times the world size": (
            forgot_mean,
            "the counts differ between ranks: all-reduce the count (x.numel() // x.shape[1] "
            "values per channel) along with the sums, and divide by the global count",
        ),
        "the global sum over this rank's count": (
            sums / own_n,
            "divide the global sum by the global count, all-reduced like the sums",
        ),
    }
    detail, hint = _compare_stat("mean", got[0], mean, wrong_means)
    if detail:
        return make_finding(case, detail, hint)
    between = "they miss the spread between the ranks' means: the global variance is the "
    wrong_vars = {
        "this rank's own variance": (
            variances[rank],
            "that is this rank's own statistic: combine the ranks' sums of x and of x² "
            "with an all_reduce",
        ),
        "the unbiased variance (divided by N - 1)": (
            var * total / (total - 1),
            "BatchNorm normalizes with the biased variance, divided by the count N "
            "(torch.var(..., correction=0)); the unbiased one, divided by N - 1, is only what "
            "it keeps in running_var",
        ),
        "the mean of the ranks' variances": (
            variances.mean(0),
            between + "mean of x² minus the square of the mean, both over all ranks, weighted "
            "by each rank's count (all-reduce the count, the sum of x and the sum of x²)",
        ),
        "the mean of the ranks' unbiased variances": (
            (variances * n[:, None] / (n[:, None] - 1)).mean(0),
            between + "mean of x² minus the square of the mean over all ranks (biased: "
            "divided by the count), weighted by each rank's count",
        ),
        "the ranks' variances weighted by their counts": (
            (variances * n[:, None]).sum(0) / n.sum(),
            between + "mean of x² minus the square of the mean, both over all ranks "
            "(all-reduce the count, the sum of x and the sum of x²)",
        ),
        "the standard deviation": (
            var.sqrt(),
            "return the variance, the square of the standard deviation",
        ),
        "computed with this rank's count in place of every rank's": (
            squares / (own_n * len(inputs)) - forgot_mean**2,
            "the counts differ between ranks: all-reduce the count along with the sums",
        ),
    }
    if torch.isnan(got[1]).any():
        return make_finding(
            case,
            "the variance holds NaN",
            "an unbiased variance divides by N - 1, which is 0 on a rank with a single sample: "
            "BatchNorm's variance is the biased one, over the whole global batch "
            "(sum of x² / N - mean²)",
        )
    detail, hint = _compare_stat("variance", got[1], var, wrong_vars)
    return make_finding(case, detail, hint)


def _compare_stat(
    what: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    wrong: dict[str, tuple[torch.Tensor, str]],
) -> tuple[str, str]:
    """("", "") if got is right; else what came out and the hint of the mistake it matches."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # float32 sums of a few values

    if close(got, expected):
        return "", ""
    shown = ", ".join(f"{v:.4f}" for v in got.tolist())
    want = ", ".join(f"{v:.4f}" for v in expected.tolist())
    detail = f"the {what} per channel is [{shown}], expected [{want}]"
    for name, (value, hint) in wrong.items():
        if close(got, value):
            return f"{detail}: that is {name}", hint
    return detail, (
        f"the {what} of each channel over every value of the global batch: all samples of all "
        f"ranks and all positions; check it against torch.var_mean on torch.cat of the ranks' x"
    )


EXERCISE = Exercise(
    key="global_batch_stats",
    name="global_batch_stats",
    functions=("global_batch_stats",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.global_batch_stats,),
    hang_hint="a collective that not every rank calls waits forever: call the same all_reduce on "
    "every rank, whatever its batch size",
    raise_hints={
        "ZeroDivisionError": "divide by the global count, summed over the ranks, never by "
        "N - 1 of a single rank: a rank can hold a single sample",
    },
)
