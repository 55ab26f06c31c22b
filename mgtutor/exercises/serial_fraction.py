"""Notebook 08's exercise: a run's serial fraction, by Amdahl's law or by Gustafson's."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import cloudpickle

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    as_number,
    call_learner,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_serial_fraction", "run"]

CASES = (  # label, kind, ranks, seconds per step on 1 rank, on n ranks
    ("strong, 4 ranks: 1.0 s per step on 1 rank, 0.325 s on 4", "strong", 4, 1.0, 0.325),
    ("weak, 4 ranks: 0.3 s per step on 1 rank, 0.4 s on 4", "weak", 4, 0.3, 0.4),
    ("strong, 8 ranks: 0.8 s on 1 rank, 0.1 s on 8 (ideal)", "strong", 8, 0.8, 0.1),
    ("strong, 2 ranks slower than 1: 0.10 s on 1 rank, 0.12 s on 2", "strong", 2, 0.10, 0.12),
    ("weak, 2 ranks faster than ideal: 0.50 s on 1 rank, 0.45 s on 2", "weak", 2, 0.50, 0.45),
)


def check_serial_fraction(
    serial_fraction: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check the serial fraction that Amdahl's or Gustafson's law reads from a measured run.

    The exercise: write ``serial_fraction(kind, n, step_time_1, step_time_n) -> float``.
    ``kind`` is ``"strong"`` (a fixed global batch: each of the ``n`` ranks takes ``1/n`` of
    it) or ``"weak"`` (a fixed per-rank batch: ``n`` ranks do ``n`` times the work of one);
    ``step_time_1`` and ``step_time_n`` are the seconds per step on 1 rank and on ``n``.
    Return the serial fraction ``s`` of the law that models that kind: Amdahl's,
    ``S = 1 / (s + (1 - s) / n)``, for strong scaling; Gustafson's, ``S = n - s (n - 1)``, for
    weak scaling, where ``S`` is the speedup (the scaled speedup for weak scaling). Do not clip
    it: outside 0 to 1 it says that the law cannot describe the run.

    The checker compares with both laws turned around on five runs, one of each kind that the
    laws describe, an ideal one, one slower than a single rank and one faster than ideal. It
    needs no process group, only one rank to run in.

    Args:
        serial_fraction: your function.
        timeout: seconds the rank may take before it is stopped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``serial_fraction`` is not a function.
    """
    return check(EXERCISE, (serial_fraction,), timeout)


def _amdahl(speedup: float, n: int) -> float:
    return (n / speedup - 1) / (n - 1)


def _gustafson(speedup: float, n: int) -> float:
    return (n - speedup) / (n - 1)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, kind, n, one, many in CASES:
        returned = call_learner(index, case, fn, kind, n, one, many)
        findings.append(_diagnose_scaling(case, returned, kind, n, one, many))
        if not findings[-1]["ok"]:
            break
    return findings


def _diagnose_scaling(
    case: str, returned: Any, kind: str, n: int, one: float, many: float
) -> Finding:
    value = as_number(case, returned, "return one number, the serial fraction s")
    if isinstance(value, dict):
        return value
    ratio = one / many  # the time ratio: strong scaling's speedup, not weak scaling's
    scaled = n * one / many  # n ranks did n times one rank's work in that time
    law, other = (_amdahl, _gustafson) if kind == "strong" else (_gustafson, _amdahl)
    speedup = ratio if kind == "strong" else scaled
    truth = law(speedup, n)
    if math.isclose(value, truth, rel_tol=1e-9, abs_tol=1e-12):
        return make_finding(case)
    law_name, other_name = ("Amdahl", "Gustafson") if kind == "strong" else ("Gustafson", "Amdahl")
    wrong = {
        f"{other_name}'s law, for {kind} scaling": (
            other(speedup, n),
            f"{kind} scaling is read with {law_name}'s law"
            + (
                ": a fixed problem split over more ranks, S = 1 / (s + (1 - s) / n), so "
                "s = (n / S - 1) / (n - 1)"
                if kind == "strong"
                else ": the problem grows with the ranks, S = n - s (n - 1), so "
                "s = (n - S) / (n - 1)"
            ),
        ),
        "the speedup": (
            speedup,
            "that is the speedup S; turn the law around to get the serial fraction s",
        ),
        "the efficiency": (
            speedup / n,
            "that is the efficiency S / n; turn the law around to get the serial fraction s",
        ),
        "1 - s, the parallel fraction": (
            1 - truth,
            "that is the parallel fraction; the serial one is s, the part that does not get "
            "faster with more ranks",
        ),
        "a clipped value": (
            min(max(truth, 0.0), 1.0),
            "do not clip: a fraction outside 0 to 1 is what the measurement gives, and says "
            "that the law cannot describe this run (slower than one rank, or faster than ideal)",
        ),
    }
    if kind == "weak":
        wrong["the time ratio as the scaled speedup"] = (
            _gustafson(ratio, n),
            "with weak scaling n ranks do n times one rank's work per step, so the scaled "
            "speedup is n x t1 / tn, not t1 / tn",
        )
        wrong["the time ratio, read with Amdahl's law"] = (
            _amdahl(ratio, n),
            "that reads weak scaling as if it were strong: the scaled speedup is n x t1 / tn "
            "and its law is Gustafson's, s = (n - S) / (n - 1)",
        )
    else:
        wrong["n x t1 / tn as the speedup"] = (
            _amdahl(scaled, n),
            "with strong scaling the n ranks share one rank's work, so the speedup is "
            "t1 / tn, without the factor n",
        )
    wrong["the speedup upside down"] = (
        law(1 / speedup, n),
        "the speedup is the old time over the new one, above 1 when n ranks are faster: "
        "t1 / tn for strong scaling, n x t1 / tn for weak scaling",
    )
    detail = f"returned {value:.6g}, expected {truth:.6g}"
    for name, (candidate, hint) in wrong.items():
        if math.isclose(value, candidate, rel_tol=1e-9, abs_tol=1e-12):
            return make_finding(case, f"{detail}: that is {name}", hint)
    return make_finding(
        case,
        detail,
        f"compute the {'' if kind == 'strong' else 'scaled '}speedup S from the two times, "
        f"then turn {law_name}'s law around for s",
    )


EXERCISE = Exercise(
    key="serial_fraction",
    name="serial_fraction",
    functions=("serial_fraction",),
    world_size=1,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.serial_fraction,),
    hang_hint="the function does not return: it needs no collective and no loop, only a "
    "speedup and one of the two laws turned around",
)
