"""How every exercise is checked, on the notebook's side: the launch, the verdict, the result.

Each exercise's module (:mod:`mgtutor.exercises.ring_average`, ...) describes itself in an
:class:`Exercise` and hands it, with the learner's functions, to :func:`check`. That recognizes
a stub still raising ``NotImplementedError`` (and then runs the exercise's reference solution,
from :mod:`mgtutor.exercises.solutions`, instead), launches the candidates on gloo ranks through
:func:`mgtutor.exercises.rank_side.run_candidates`, and turns what came back (every rank's
findings, an exception in the learner's code, a hang, a dead rank) into a :class:`CheckResult`.
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mgtutor.errors import WorkerError, WorkerTimeout
from mgtutor.exercises import rank_side
from mgtutor.exercises.check_result import FAILED, NOT_ATTEMPTED, PASSED, CheckResult
from mgtutor.exercises.rank_side import Finding, LearnerFailed, run_candidates

__all__ = ["Exercise", "check", "check_all"]


@dataclass(frozen=True)
class Exercise:
    """One exercise: what the learner writes, how its cases run, and how a failure is told.

    Attributes:
        key: its name, that of its module (``"ring_average"``) and of its tests' rows.
        name: the learner's function(s), as the notebook names them.
        functions: each function's name, in the order the checker takes them.
        world_size: the ranks its cases run on.
        cases: one line per case, shown with the result.
        run: what each rank runs for one candidate (its module's ``run``): the cases, and a
            finding for each.
        reference: mgtutor's solution, from :mod:`mgtutor.exercises.solutions`, one function
            per name in ``functions``; run when the learner's is still the stub.
        hang_hint: the hint when the ranks had to be stopped.
        raise_hints: the hint when the learner's function raised, by the exception's type name.
        needs_folder: whether its cases write files (into a scratch folder, removed after).
    """

    key: str
    name: str
    functions: tuple[str, ...]
    world_size: int
    cases: tuple[str, ...]
    run: Callable[[bytes, int, str | None], list[Finding]]
    reference: tuple[Callable[..., Any], ...]
    hang_hint: str
    raise_hints: dict[str, str] = field(default_factory=dict)
    needs_folder: bool = False


def check(exercise: Exercise, functions: tuple, timeout: float) -> CheckResult:
    """What the public ``check_*`` functions do: check the learner's functions, or the reference.

    Args:
        exercise: the exercise.
        functions: the learner's functions, in the order of ``exercise.functions``.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`; for a stub, ``"not attempted"`` with the reference's result.

    Raises:
        TypeError: one of ``functions`` is not a function.
        RuntimeError: the reference solution failed its own check (a bug in mgtutor).
    """
    for name, fn in zip(exercise.functions, functions):
        if not callable(fn):
            raise TypeError(
                f"the checker needs your function {name}, got {fn!r}; pass the function "
                f"itself, without calling it: check(...)({name}), not check({name}(...))"
            )
    stubs = [name for name, fn in zip(exercise.functions, functions) if _is_stub(fn)]
    if stubs:
        verb = "raises" if len(stubs) == 1 else "raise"
        return _not_attempted(exercise, f"{' and '.join(stubs)} still {verb} NotImplementedError")
    (result,) = check_all(exercise, [functions], timeout)
    if result.status == NOT_ATTEMPTED:
        return _not_attempted(exercise, result.message)
    return result


def _not_attempted(exercise: Exercise, why: str) -> CheckResult:
    (result,) = check_all(exercise, [exercise.reference], timeout=120.0, label="reference solution")
    if not result.passed:
        raise RuntimeError(
            f"mgtutor's reference solution failed its own check; this is a bug in mgtutor, "
            f"please report it:\n{result!r}"
        )
    return CheckResult(
        exercise.name,
        NOT_ATTEMPTED,
        f"Not attempted yet: {why}. Write your answer in its cell, run that cell, then run "
        f"this one again. What passing looks like, mgtutor's own solution through the same "
        f"checks:",
        cases=exercise.cases,
        world_size=exercise.world_size,
        reference=result,
    )


def _is_stub(fn: Callable[..., Any]) -> bool:
    """Whether fn's body (past a docstring) is only ``raise NotImplementedError``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False  # no source to read: it runs, and a NotImplementedError is reported then
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def check_all(
    exercise: Exercise,
    candidates: Sequence[tuple],
    timeout: float = 20.0,
    label: str = "",
) -> list[CheckResult]:
    """Run several candidates through one exercise, in as few launches as possible.

    All candidates run one after the other in one launch. When one raises, it is reported and
    the others run again without it; when a launch hangs with several candidates in it, each
    runs alone, so that the hang is blamed on the right one. The tests use this to check many
    wrong answers for the price of one launch.

    Args:
        exercise: the exercise.
        candidates: tuples of the functions the exercise takes.
        timeout: seconds per launch, from when every rank started.
        label: added to each result's name ("reference solution").

    Returns:
        One :class:`CheckResult` per candidate, in order.
    """
    from mgtutor.launcher.launch import launch
    from mgtutor.wire.pickling import dumps

    name = f"{exercise.name} ({label})" if label else exercise.name
    results: dict[int, CheckResult] = {}
    pending = list(range(len(candidates)))
    while pending:
        payloads = []
        for i in list(pending):
            try:
                payloads.append(dumps(tuple(candidates[i])))
            except Exception as exc:
                pending.remove(i)
                results[i] = CheckResult(
                    name,
                    FAILED,
                    f"Your function could not be sent to the ranks: {type(exc).__name__}: {exc}",
                    hint="each rank gets a pickled copy of the function and of the globals it "
                    "uses; create locks, open files, generators and the like inside it.",
                    cases=exercise.cases,
                    world_size=exercise.world_size,
                )
        if not pending:
            break
        folder = tempfile.mkdtemp(prefix="mgtutor-exercise-") if exercise.needs_folder else None
        try:
            run = launch(
                run_candidates,
                exercise.run,
                payloads,
                folder,
                world_size=exercise.world_size,
                backend="gloo",
                timeout=timeout,
            )
        except WorkerTimeout as exc:
            if len(pending) > 1:
                for i in pending:
                    (results[i],) = check_all(exercise, [candidates[i]], timeout, label)
                break
            results[pending[0]] = _hung(name, exercise, exc, timeout)
            break
        except WorkerError as exc:
            failure = _learner_failure(exc)
            if failure is not None and 0 <= failure.index < len(pending):
                culprit = pending.pop(failure.index)
                results[culprit] = _raised(name, exercise, failure)
                continue  # the others again, without it
            if len(pending) > 1:
                for i in pending:
                    (results[i],) = check_all(exercise, [candidates[i]], timeout, label)
                break
            results[pending[0]] = _crashed(name, exercise, exc)
            break
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        for position, i in enumerate(pending):
            findings = [rank_reports[position] for rank_reports in run.results]
            results[i] = _verdict(name, exercise, findings)
        break
    return [results[i] for i in range(len(candidates))]


def _count(cases: tuple[str, ...]) -> str:
    return "The one case" if len(cases) == 1 else f"All {len(cases)} cases"


def _on_ranks(world_size: int) -> str:
    return f" on every one of the {world_size} ranks" if world_size > 1 else ""


def _verdict(name: str, exercise: Exercise, findings: list[list[dict]]) -> CheckResult:
    """Passed, or the first case that went wrong, on the rank whose finding says most."""
    for number in range(max(len(rank_findings) for rank_findings in findings)):
        failing = [
            (rank_findings[number].get("knock_on", False), rank, rank_findings[number])
            for rank, rank_findings in enumerate(findings)
            if number < len(rank_findings) and not rank_findings[number]["ok"]
        ]
        if failing:
            _, rank, finding = min(failing, key=lambda item: item[:2])
            return CheckResult(
                name,
                FAILED,
                f"Case {finding['case']!r}"
                + (f", rank {rank}" if exercise.world_size > 1 else "")
                + f": {finding['detail']}.",
                hint=finding["hint"] + ".",
                cases=exercise.cases,
                world_size=exercise.world_size,
            )
    return CheckResult(
        name,
        PASSED,
        f"{_count(exercise.cases)} right{_on_ranks(exercise.world_size)}.",
        cases=exercise.cases,
        world_size=exercise.world_size,
    )


def _learner_failure(exc: WorkerError) -> LearnerFailed | None:
    if isinstance(exc.original, LearnerFailed):
        return exc.original
    return LearnerFailed.parse(exc.exc_message or "") or LearnerFailed.parse(str(exc))


def _raised(name: str, exercise: Exercise, failure: LearnerFailed) -> CheckResult:
    where = f"Case {failure.case!r}, rank {failure.rank}"
    if failure.exc_type == "NotImplementedError":
        return CheckResult(
            name,
            NOT_ATTEMPTED,
            f"{' or '.join(exercise.functions)} raised NotImplementedError",
            cases=exercise.cases,
            world_size=exercise.world_size,
        )
    hint = exercise.raise_hints.get(
        failure.exc_type, "read the traceback: its last lines are in your function"
    )
    return CheckResult(
        name,
        FAILED,
        f"{where} raised {failure.exc_type}: {failure.message}\n\n"
        f"Traceback (in rank {failure.rank}):\n{failure.where}",
        hint=hint + ".",
        cases=exercise.cases,
        world_size=exercise.world_size,
    )


# In a rank's stack, the frames below this file's call_learner are the learner's.
_CALL_FILE = os.path.abspath(rank_side.__file__)


def _hung(name: str, exercise: Exercise, exc: WorkerTimeout, timeout: float) -> CheckResult:
    lines = [
        f"Did not finish within {timeout:g} s; rank(s) {exc.running} were still running and "
        f"were stopped."
    ]
    for rank in exc.running:
        stack = (exc.stacks.get(rank) or "").splitlines()
        inside = next(
            (
                i
                for i, line in enumerate(stack)
                if _CALL_FILE in line and line.rstrip().endswith(" call_learner")
            ),
            None,
        )
        if inside is not None:
            inside = next(
                (i for i in range(inside + 1, len(stack)) if stack[i].startswith("  File ")),
                len(stack),
            )
        if not stack:
            lines.append(f"Rank {rank}: no stack came back.")
        elif inside is None:
            lines.append(
                f"Rank {rank} was not in your function: it had returned (or not "
                f"started it) and waited for the other ranks."
            )
        else:
            lines += [f"Where rank {rank} was waiting (most recent call last):", *stack[inside:]]
    return CheckResult(
        name,
        FAILED,
        "\n".join(lines),
        hint=exercise.hang_hint + ".",
        cases=exercise.cases,
        world_size=exercise.world_size,
    )


def _crashed(name: str, exercise: Exercise, exc: WorkerError) -> CheckResult:
    return CheckResult(
        name,
        FAILED,
        f"A rank died outside your function's Python code: {exc.summary}",
        hint="the usual cause is collectives that do not match across the ranks (one rank "
        "calls a collective the others do not, or with another size), which gloo detects and "
        "aborts on; call the same collectives in the same order on every rank. If the "
        "reference solution fails the same way, it is a bug in mgtutor.",
        cases=exercise.cases,
        world_size=exercise.world_size,
    )
