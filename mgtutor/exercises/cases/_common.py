"""What every exercise's cases share: the learner's call, its failure, a finding per case."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Finding", "ForbiddenCollective", "LearnerFailed"]

Finding = dict[str, Any]

_FAILURE_MARK = "mgtutor-exercise-failure:"
_HERE = os.path.dirname(os.path.abspath(__file__))


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


def _learner_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _HERE:
        tb = tb.tb_next  # this package's frames: the learner's own start below them
    frames = traceback.extract_tb(tb)[-6:]
    return "".join(traceback.format_list(frames)) + f"{type(exc).__name__}: {exc}"


def _call(index: int, case: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise LearnerFailed(
            index, case, dist.get_rank(), type(exc).__name__, str(exc), _learner_traceback(exc)
        ) from None


def _finding(case: str, detail: str = "", hint: str = "", *, knock_on: bool = False) -> Finding:
    # knock_on: a symptom another rank's mistake can cause here; the verdict prefers a rank
    # whose finding names the mistake itself.
    return {"case": case, "ok": not detail, "detail": detail, "hint": hint, "knock_on": knock_on}


def _as_number(case: str, returned: Any, hint: str) -> float | Finding:
    """The learner's answer as a float, or the finding that says it is not one number."""
    try:
        return float(returned)
    except (TypeError, ValueError, RuntimeError):
        return _finding(case, f"returned {type(returned).__name__} {returned!r:.60}", hint)


def _everyone_ok(finding: Finding) -> bool:
    """Whether every rank's finding for this case is right (a collective: call it on all).

    A candidate's cases stop at the first one that fails on any rank: its later cases could
    raise or hang for the same mistake, and the verdict reports the first failure anyway.
    """
    flag = torch.tensor([1 if finding["ok"] else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        u is not None and torch.allclose(u, v, rtol=1e-9, atol=1e-12) for u, v in zip(a, b)
    )
