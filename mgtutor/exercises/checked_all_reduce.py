"""Notebook 10's exercise: an all-reduce that refuses, on every rank, tensors that differ."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    LearnerFailed,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_checked_all_reduce", "run"]

CASES = (  # label, shape on each rank, dtype on each rank
    ("(3, 4) float32 on both ranks", ((3, 4), (3, 4)), ("float32", "float32")),
    ("0-d float64 tensors on both ranks (a loss)", ((), ()), ("float64", "float64")),
    ("(2, 3) on rank 0, (3, 2) on rank 1: as many elements", ((2, 3), (3, 2)), ("float32",) * 2),
    ("0-d on rank 0, (1,) on rank 1: one element each", ((), (1,)), ("float32",) * 2),
    ("(4,) float32 on rank 0, (4,) float64 on rank 1", ((4,), (4,)), ("float32", "float64")),
)
_STATE_BYTES = 512
# The collectives a check or a reduction may call, and the argument each one's ranks must match.
_GUARDED = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
}


def check_checked_all_reduce(
    checked_all_reduce: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check an all-reduce that refuses, on every rank, tensors that differ between ranks.

    The exercise: write ``checked_all_reduce(tensor) -> None``. When every rank's tensor has
    the same shape and dtype, it sums them in place, as ``dist.all_reduce(tensor)`` does;
    otherwise it raises ``ValueError`` on every rank, with a message naming each rank and its
    shape (or dtype), instead of letting gloo sum mismatched tensors or end a rank.

    The checker runs it on 2 ranks: matching tensors (a 0-d one too), shapes with as many
    elements, a 0-d tensor against a ``(1,)`` one, and two dtypes. While it runs, every
    collective first compares what the ranks pass to it, so that a missing check is reported
    instead of corrupting the sum, ending a rank or hanging.

    Args:
        checked_all_reduce: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``checked_all_reduce`` is not a function.
    """
    return check(EXERCISE, (checked_all_reduce,), timeout)


class _Desync(BaseException):
    """Raised in place of a collective whose ranks disagree, or that some rank never calls.

    A BaseException, so that an ``except Exception`` in the learner's function does not hide it.
    """

    def __init__(self, states: list[dict[str, Any]]) -> None:
        super().__init__(states)
        self.states = states


class _CollectiveGuard:
    """Let matching collectives through; stop the ones that would abort a rank or wait forever.

    Each guarded collective on the default group first tells every rank what this rank is about
    to call (operation, shape, dtype) on a separate gloo group; when the ranks disagree, or when
    one of them has already left the learner's function, every rank involved raises
    :class:`_Desync` instead. :meth:`finish` is that same exchange for a rank that has left the
    function, so that each rank takes part in as many exchanges as the others.
    """

    def __init__(self, group: object) -> None:
        from torch.distributed import distributed_c10d

        self.group = group
        self.ended = False
        self.real = {name: getattr(distributed_c10d, name) for name in _GUARDED}
        self.modules = (dist, distributed_c10d)

    def __enter__(self) -> _CollectiveGuard:
        for module in self.modules:
            for name in _GUARDED:
                setattr(module, name, self._guarded(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for module in self.modules:
            for name, real in self.real.items():
                setattr(module, name, real)

    def _exchange(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        data = json.dumps(state).encode()[:_STATE_BYTES]
        mine = torch.zeros(_STATE_BYTES, dtype=torch.uint8)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self.real["all_gather"](everyone, mine, group=self.group)
        return [json.loads(bytes(t.tolist()).rstrip(b"\0")) for t in everyone]

    def _guarded(self, name: str) -> Callable[..., Any]:
        import inspect

        real = self.real[name]
        signature = inspect.signature(real)

        def collective(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return real(*args, **kwargs)  # torch's own error for a wrong call
            group = bound.arguments.get("group")
            tensor = bound.arguments.get(_GUARDED[name])
            if self.ended or group not in (None, dist.group.WORLD):
                return real(*args, **kwargs)
            state = {"op": name, "shape": list(getattr(tensor, "shape", ())), "dtype": ""}
            state["dtype"] = str(getattr(tensor, "dtype", "")).replace("torch.", "")
            states = self._exchange(state)
            if any(s != states[0] for s in states):
                self.ended = True
                raise _Desync(states)
            return real(*args, **kwargs)

        return collective

    def finish(self, outcome: str) -> list[dict[str, Any]] | None:
        """Tell the others this rank has left the function (``outcome``); their states."""
        if self.ended:
            return None
        self.ended = True
        return self._exchange({"op": "done", "outcome": outcome})


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank = dist.get_rank()
    side = dist.new_group(backend="gloo")
    findings = []
    for number, (case, shapes, dtypes) in enumerate(CASES):
        inputs = [
            torch.randint(
                -9, 10, shape, generator=torch.Generator().manual_seed(10 * number + r)
            ).to(getattr(torch, dtype))
            for r, (shape, dtype) in enumerate(zip(shapes, dtypes))
        ]
        tensor = inputs[rank].clone()
        returned = failure = desync = None
        with _CollectiveGuard(side) as guard:
            (fn,) = cloudpickle.loads(payload)  # a collective imported by name is guarded too
            try:
                returned = call_learner(index, case, fn, tensor)
            except LearnerFailed as exc:
                failure = exc
            except _Desync as exc:
                desync = exc.states
            outcome = "returned" if failure is None else f"raised {failure.exc_type}"
            others = guard.finish(outcome)
        matching = len(set(shapes)) == 1 and len(set(dtypes)) == 1
        if failure is not None and failure.exc_type != "ValueError" and matching:
            raise failure
        findings.append(
            _diagnose_checked(case, inputs, tensor, returned, failure, desync, others, matching)
        )
        if not everyone_ok(findings[-1]):
            break
    dist.destroy_process_group(side)
    return findings


def _shape_text(shape: Iterable[int]) -> str:
    return str(tuple(shape))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _desync_finding(case: str, states: list[dict[str, Any]]) -> Finding:
    left = [r for r, s in enumerate(states) if s["op"] == "done"]
    if left:
        waiting = [r for r, s in enumerate(states) if s["op"] != "done"]
        how = states[left[0]].get("outcome", "left")
        return make_finding(
            case,
            f"{_ranks(waiting)} went on to dist.{states[waiting[0]]['op']} while "
            f"{_ranks(left)} had left the function ({how}): {_ranks(waiting)} would wait "
            f"there forever",
            "every rank must reach the same decision: gather every rank's shape and dtype to "
            "every rank (dist.all_gather_object), then let each rank compare them and raise",
        )
    ops = {s["op"] for s in states}
    per_rank = ", ".join(
        f"rank {r}: {s['op']} of {_shape_text(s['shape'])} {s['dtype']}"
        for r, s in enumerate(states)
    )
    if len(ops) > 1:
        return make_finding(
            case,
            f"the ranks called different collectives ({per_rank})",
            "call the same collectives in the same order on every rank",
        )
    (op,) = ops
    if op != "all_reduce":
        return make_finding(
            case,
            f"your check's own dist.{op} got tensors that differ between the ranks ({per_rank}), "
            "which gloo cannot gather",
            "the shape of a 0-d tensor has length 0, of a (1,) tensor length 1: "
            "torch.tensor(x.shape) differs in length between the ranks. Gather the shapes as "
            "Python objects (dist.all_gather_object) or pad them to a fixed length",
        )
    if len({tuple(s["shape"]) for s in states}) == 1:
        return make_finding(
            case,
            f"dist.all_reduce was called with different dtypes ({per_rank}); gloo reduces the "
            f"bytes as if they were the same type",
            "compare the dtypes too, not only the shapes, and raise ValueError on every rank",
        )
    return make_finding(
        case,
        f"dist.all_reduce was called with different shapes ({per_rank}); gloo either sums "
        f"them element by element as if they matched or ends the rank (SIGABRT)",
        "before reducing, gather every rank's (shape, dtype) with dist.all_gather_object and "
        "raise ValueError on every rank when they differ; comparing the number of elements "
        "is not enough",
    )


def _diagnose_checked(
    case: str,
    inputs: list[torch.Tensor],
    tensor: torch.Tensor,
    returned: object,
    failure: LearnerFailed | None,
    desync: list[dict[str, Any]] | None,
    others: list[dict[str, Any]] | None,
    matching: bool,
) -> Finding:
    if desync is not None:
        return _desync_finding(case, desync)
    if matching:
        if failure is not None:
            return make_finding(
                case,
                f"raised ValueError although every rank holds the same shape and dtype: "
                f"{failure.message}",
                "raise only when the shapes or the dtypes differ",
            )
        expected = sum(inputs[1:], inputs[0].clone())
        if torch.equal(tensor, expected):
            return make_finding(case)
        if isinstance(returned, torch.Tensor) and torch.equal(returned, expected):
            return make_finding(
                case,
                "returned the sum but left the tensor it was given unchanged",
                "reduce in place, like dist.all_reduce: dist.all_reduce(tensor) writes the sum "
                "into tensor",
            )
        if torch.equal(tensor, expected / len(inputs)):
            return make_finding(
                case,
                "the tensor holds the mean over the ranks",
                "sum, like dist.all_reduce's default (ReduceOp.SUM); do not divide",
            )
        return make_finding(
            case,
            f"the tensor holds {tensor.tolist()}, expected the sum {expected.tolist()}",
            "after the check, dist.all_reduce(tensor) on every rank",
        )
    if failure is None:
        raised = [
            r for r, s in enumerate(others or []) if s.get("outcome", "").startswith("raised")
        ]
        return make_finding(
            case,
            "returned without raising although the ranks' tensors differ"
            + (f", while rank(s) {raised} raised" if raised else ""),
            "every rank must reach the same decision: gather every rank's shape and dtype to "
            "every rank (dist.all_gather_object), then let each rank compare them and raise "
            "ValueError",
        )
    if failure.exc_type != "ValueError":
        return make_finding(
            case,
            f"raised {failure.exc_type}: {failure.message}",
            "raise ValueError (a wrong argument), not another exception; an assert disappears "
            "under python -O",
        )
    return _check_message(case, inputs, failure.message)


def _check_message(case: str, inputs: list[torch.Tensor], message: str) -> Finding:
    """Whether a ValueError's message names every rank and what differs there."""
    if len({t.dtype for t in inputs}) > 1:
        named = [str(t.dtype).replace("torch.", "") for t in inputs]
        what = "dtypes"
    else:
        named = [_shape_text(t.shape) for t in inputs]
        what = "shapes"
    spellings = [
        [_shape_text(t.shape), str(list(t.shape))] if what == "shapes" else [named[r]]
        for r, t in enumerate(inputs)
    ]
    missing = [r for r, forms in enumerate(spellings) if not any(f in message for f in forms)]
    rest = message
    for forms in spellings:
        for form in forms:
            rest = rest.replace(form, " ")
    unnamed = [r for r in range(len(inputs)) if not re.search(rf"\b{r}\b", rest)]
    if missing or unnamed:
        return make_finding(
            case,
            f"the ValueError says {message!r}; it should name every rank and its {what} "
            f"(here {', '.join(f'rank {r} {text}' for r, text in enumerate(named))})",
            "gather (shape, dtype) from every rank, and put each rank with its shape and dtype "
            "in the message, for example 'shapes differ: rank 0 (2, 3), rank 1 (3, 2)'",
        )
    return make_finding(case)


EXERCISE = Exercise(
    key="checked_all_reduce",
    name="checked_all_reduce",
    functions=("checked_all_reduce",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.checked_all_reduce,),
    hang_hint="the ranks' collectives did not pair up: one rank waits in a collective that "
    "another never calls. Gather the shapes on every rank with the same call, decide on "
    "every rank, and either raise on all of them or all-reduce on all of them",
)
