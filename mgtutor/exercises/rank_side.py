"""What runs inside each rank while an exercise is checked: the learner's call, its findings.

:mod:`.checking` launches :func:`run_candidates` on CPU ranks with one exercise's ``run``. For
every candidate (a learner's function, or a tuple of them) that ``run`` builds each case's
inputs the same way on every rank, calls the candidate through :func:`call_learner`, and
compares what came out with what must come out. The expected result never comes from a
collective: each rank computes it from all ranks' inputs, or reads it from torch itself (the
buckets DDP built, memplan's rules), so a wrong answer cannot hide behind a reference that
shares its mistake (the checker's own collectives, :func:`everyone_ok`, only let the ranks agree
to stop at the first failing case). Each case yields a finding,
``{"case", "ok", "detail", "hint", "knock_on"}``; the notebook's process turns the first
failing one into the verdict.

A candidate that raises is reported as :class:`LearnerFailed`, carrying which candidate, which
case, which rank, and the learner's own part of the traceback.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Finding",
    "ForbiddenCollective",
    "LearnerFailed",
    "as_number",
    "call_learner",
    "everyone_ok",
    "make_finding",
    "run_candidates",
    "same_tensors",
]

Finding = dict[str, Any]

_FAILURE_MARK = "mgtutor-exercise-failure:"
# The exercises' folder: a learner's traceback starts below the frames of its modules (the
# reference solutions, which stand in for a learner's functions, excepted).
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOLUTIONS = os.path.join(_HERE, "solutions.py")


class LearnerFailed(Exception):
    """The learner's function raised in one rank while a check ran it.

    Its message is machine-readable (the notebook's process parses it when the exception object
    itself cannot be sent back); the attributes say the same.
    """

    def __init__(
        self, index: int, case: str, rank: int, exc_type: str, message: str, where: str
    ) -> None:
        super().__init__(index, case, rank, exc_type, message, where)
        self.index, self.case, self.rank = index, case, rank
        self.exc_type, self.message, self.where = exc_type, message, where

    def __str__(self) -> str:
        return _FAILURE_MARK + json.dumps(self.args)

    @classmethod
    def parse(cls, text: str) -> LearnerFailed | None:
        """Rebuild one from its message, or None if ``text`` is not such a message."""
        start = text.find(_FAILURE_MARK)
        if start < 0:
            return None
        try:
            return cls(*json.JSONDecoder().raw_decode(text[start + len(_FAILURE_MARK) :])[0])
        except (ValueError, TypeError):
            return None


class ForbiddenCollective(RuntimeError):
    """Raised in place of a collective that an exercise asks to build from messages instead."""


def _is_checkers(filename: str) -> bool:
    return os.path.dirname(filename) == _HERE and filename != _SOLUTIONS


def _learner_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and _is_checkers(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next  # the checker's frames: the learner's own start below them
    frames = traceback.extract_tb(tb)[-6:]
    return "".join(traceback.format_list(frames)) + f"{type(exc).__name__}: {exc}"


def call_learner(index: int, case: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the learner's function; what it raises comes out as :class:`LearnerFailed`.

    The checker finds the learner's frames in a hung rank's stack below this function's.
    """
    try:
        return fn(*args)
    except Exception as exc:
        raise LearnerFailed(
            index, case, dist.get_rank(), type(exc).__name__, str(exc), _learner_traceback(exc)
        ) from None


def make_finding(case: str, detail: str = "", hint: str = "", *, knock_on: bool = False) -> Finding:
    """One case's finding: right when ``detail`` (what went wrong) is empty.

    ``knock_on`` marks a symptom another rank's mistake can cause here; the verdict prefers a
    rank whose finding names the mistake itself.
    """
    return {"case": case, "ok": not detail, "detail": detail, "hint": hint, "knock_on": knock_on}


def as_number(case: str, returned: Any, hint: str) -> float | Finding:
    """The learner's answer as a float, or the finding that says it is not one number."""
    try:
        return float(returned)
    except (TypeError, ValueError, RuntimeError):
        return make_finding(case, f"returned {type(returned).__name__} {returned!r:.60}", hint)


def everyone_ok(finding: Finding) -> bool:
    """Whether every rank's finding for this case is right (a collective: call it on all).

    A candidate's cases stop at the first one that fails on any rank: its later cases could
    raise or hang for the same mistake, and the verdict reports the first failure anyway.
    """
    flag = torch.tensor([1 if finding["ok"] else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def same_tensors(a: list, b: list) -> bool:
    """Whether two lists of tensors match one by one, to float64's rounding (None never does)."""
    return len(a) == len(b) and all(
        u is not None and torch.allclose(u, v, rtol=1e-9, atol=1e-12) for u, v in zip(a, b)
    )


def run_candidates(
    run: Callable[[bytes, int, str | None], list[Finding]],
    payloads: list[bytes],
    folder: str | None,
) -> list[list[Finding]]:
    """Run each pickled candidate through one exercise's cases; one list of findings each.

    Args:
        run: the exercise's ``run`` (``mgtutor.exercises.ring_average.run``, ...).
        payloads: cloudpickled tuples of the candidate's functions.
        folder: a scratch folder the exercise may write to (the snapshot's), or None.

    Returns:
        For each candidate, one finding per case, in order.

    Raises:
        LearnerFailed: a candidate raised; the candidates after it did not run.
    """
    from mgtutor.worker import setup

    setup(backend="gloo")
    reports = []
    for index, payload in enumerate(payloads):
        reports.append(run(payload, index, folder))
        dist.barrier()
    return reports
