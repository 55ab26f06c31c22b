"""Exercises that check themselves: run a learner's function on CPU ranks, say what is wrong.

Each notebook from DDP on ends with exercises where you write one function; the cell after it
calls a checker from this module, which runs your function with :func:`mgtutor.launch` on gloo
ranks, on several inputs chosen to catch the classic mistakes (uneven shards, fewer values than
ranks, a short last window, another rank's generator state), and answers with a
:class:`CheckResult`: passed, or the first case that went wrong, what came out, and a hint::

    def ring_average(tensor):
        raise NotImplementedError  # your code here

    check_ring_average(ring_average)   # "not attempted yet", then the reference solution's run

While your cell still holds the stub, the checker says so and runs mgtutor's own solution
through the same checks, to show what passing looks like (the reference solutions live in
:mod:`mgtutor._solutions`; read them once yours passes). A function that raises is reported
with the rank and its traceback; one that hangs is stopped after ``timeout`` seconds and
reported with where each rank was waiting.

The checkers: :func:`check_ring_average` (notebook 02), :func:`check_exact_accuracy` (03),
:func:`check_global_batch_stats` (04), :func:`check_accumulation` (05), :func:`check_buckets`
(07), :func:`check_snapshot` (09), :func:`check_checked_all_reduce` (10),
:func:`check_bytes_per_rank` (12).
"""

from __future__ import annotations

import ast
import html
import inspect
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mgtutor._exercise_cases import (
    ACCUMULATION_CASES,
    ACCURACY_CASES,
    BATCH_STATS_CASES,
    BUCKET_CASES,
    BYTES_CASES,
    CHECKED_CASES,
    RING_CASES,
    LearnerFailed,
    TrainingJob,
    run_candidates,
)
from mgtutor.errors import WorkerError, WorkerTimeout

__all__ = [
    "CheckResult",
    "TrainingJob",
    "check_accumulation",
    "check_buckets",
    "check_bytes_per_rank",
    "check_checked_all_reduce",
    "check_exact_accuracy",
    "check_global_batch_stats",
    "check_ring_average",
    "check_snapshot",
]

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"


@dataclass(frozen=True)
class CheckResult:
    """What a checker found: shown as a coloured box in Jupyter, as text elsewhere.

    Attributes:
        exercise: the name of the function checked (``"ring_average"``).
        status: ``"passed"``, ``"failed"`` or ``"not attempted"`` (the function is still the
            stub that raises ``NotImplementedError``).
        message: what happened: the cases passed, or the first case that failed and what came
            out there.
        hint: what to look at when it failed ("" otherwise).
        cases: the cases the checker runs.
        world_size: the number of ranks it ran on.
        reference: for ``"not attempted"``, the result of mgtutor's reference solution run
            through the same checks.
    """

    exercise: str
    status: str
    message: str
    hint: str = ""
    cases: tuple[str, ...] = ()
    world_size: int = 2
    reference: CheckResult | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        """Whether the function passed every case."""
        return self.status == PASSED

    def __repr__(self) -> str:
        lines = [f"{self.exercise}: {self.status.upper()}", *_indent(self.message)]
        if self.hint:
            lines += _indent(f"Hint: {self.hint}")
        if self.reference is not None:
            lines += _indent(repr(self.reference))
        return "\n".join(lines)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        colour = {PASSED: "#2e7d32", FAILED: "#c62828"}.get(self.status, "#757575")
        parts = [
            f'<div style="border-left: 4px solid {colour}; padding: 2px 10px; margin: 4px 0">',
            f'<b style="color: {colour}">{html.escape(self.exercise)}: '
            f"{html.escape(self.status.upper())}</b>",
            f'<pre style="white-space: pre-wrap; margin: 4px 0">{html.escape(self.message)}</pre>',
        ]
        if self.hint:
            parts.append(f"<p><i>Hint:</i> {html.escape(self.hint)}</p>")
        if self.cases and self.reference is None:
            items = "".join(f"<li>{html.escape(case)}</li>" for case in self.cases)
            parts.append(
                "<details><summary>the cases"
                + (f", on {self.world_size} ranks" if self.world_size > 1 else "")
                + "</summary>"
                f"<ul>{items}</ul></details>"
            )
        if self.reference is not None:
            parts.append(self.reference._repr_html_())
        parts.append("</div>")
        return "".join(parts)


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]


@dataclass(frozen=True)
class _Exercise:
    name: str  # the learner's function(s), as the notebook names them
    functions: tuple[str, ...]
    world_size: int
    cases: tuple[str, ...]
    hang_hint: str
    raise_hints: dict[str, str] = field(default_factory=dict)  # by the exception's type name
    needs_folder: bool = False


_EXERCISES = {
    "ring_average": _Exercise(
        "ring_average",
        ("ring_average",),
        3,
        tuple(case for case, _, _ in RING_CASES),
        "every rank waits for a message that its neighbour never sends: check that each "
        "send has a matching recv on the neighbour, and send with dist.isend (if every rank "
        "first sends with a blocking send, all of them can wait at once)",
        {
            "IndexError": "tensor.chunk(n) returns fewer than n pieces when the tensor is "
            "short (4 rows in 3 chunks: 2 pieces of 2); tensor.view(-1).tensor_split(n) always "
            "returns n, some of them empty",
        },
    ),
    "exact_accuracy": _Exercise(
        "exact_accuracy",
        ("exact_accuracy",),
        2,
        tuple(case for case, *_ in ACCURACY_CASES),
        "a collective that not every rank calls waits forever: call it on every rank, even "
        "one with no real sample, outside any if-block",
        {
            "ZeroDivisionError": "a rank can hold no real sample at all (1 sample on 2 ranks): "
            "sum the correct and the sample counts over the ranks first, then divide once",
        },
    ),
    "accumulate": _Exercise(
        "accumulate",
        ("accumulate",),
        2,
        tuple(case for case, _, _ in ACCUMULATION_CASES),
        "the ranks must run the same number of backward passes outside no_sync: each one "
        "all-reduces, and a rank that skips one leaves the others waiting",
    ),
    "snapshot": _Exercise(
        "save_snapshot / load_snapshot",
        ("save_snapshot", "load_snapshot"),
        2,
        (
            "train epoch 0, save_snapshot, a new process group and a fresh job, load_snapshot, "
            "train epoch 1: the same losses and weights as without the restart, bit for bit",
        ),
        "a collective called on some ranks only (say, a gather inside if rank == 0) waits "
        "forever; call collectives on every rank",
        needs_folder=True,
    ),
    "global_batch_stats": _Exercise(
        "global_batch_stats",
        ("global_batch_stats",),
        2,
        tuple(case for case, _, _ in BATCH_STATS_CASES),
        "a collective that not every rank calls waits forever: call the same all_reduce on "
        "every rank, whatever its batch size",
        {
            "ZeroDivisionError": "divide by the global count, summed over the ranks, never by "
            "N - 1 of a single rank: a rank can hold a single sample",
        },
    ),
    "checked_all_reduce": _Exercise(
        "checked_all_reduce",
        ("checked_all_reduce",),
        2,
        tuple(case for case, _, _ in CHECKED_CASES),
        "the ranks' collectives did not pair up: one rank waits in a collective that another "
        "never calls. Gather the shapes on every rank with the same call, decide on every rank, "
        "and either raise on all of them or all-reduce on all of them",
    ),
    "bytes_per_rank": _Exercise(
        "bytes_per_rank",
        ("bytes_per_rank",),
        1,
        tuple(case for case, *_ in BYTES_CASES),
        "the function does not return: it computes a few numbers, with no collective and no loop "
        "over the parameters",
    ),
    "assign_buckets": _Exercise(
        "assign_buckets",
        ("assign_buckets",),
        2,
        tuple(case for case, *_ in BUCKET_CASES),
        "the function does not return: it needs no collective, only one pass over the sizes",
    ),
}


def check_ring_average(ring_average: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check a ring all-reduce that averages, built from point-to-point messages.

    The exercise: write ``ring_average(tensor) -> None``, which replaces ``tensor`` on every
    rank, in place, by its mean over all ranks (what DDP does to gradients), using only
    ``dist.send``/``recv``/``isend``/``irecv`` (or ``batch_isend_irecv``): a reduce-scatter
    then an all-gather around the ring. It must work for any shape (a 0-d tensor too), any
    number of elements (fewer than the ranks too) and float16, float32 or float64.

    The checker runs it on 3 ranks and compares with the mean computed from all ranks' inputs.
    Collectives (``dist.all_reduce`` and friends) raise while it runs.

    Args:
        ring_average: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``ring_average`` is not a function.

    Example:
        >>> check_ring_average(ring_average).passed
        True
    """
    return _check_one(_EXERCISES["ring_average"], (ring_average,), timeout)


def check_exact_accuracy(
    exact_accuracy: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check an exact distributed accuracy that does not count the sampler's padded repeats.

    The exercise: write ``exact_accuracy(correct, sampler) -> float``. ``sampler`` is this
    rank's ``DistributedSampler`` (padded, as by default, or with ``drop_last=True``;
    shuffled or not), and ``correct`` a bool tensor with one entry per index it gives this
    rank, in its order: whether the model got that sample right. Return, on every rank, the
    accuracy over the samples the sampler hands out, each counted once.

    The checker runs it on 2 ranks, with datasets whose size does not divide by 2, one that
    does, one where a rank holds nothing but the repeat, and ``drop_last=True``.

    Args:
        exact_accuracy: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``exact_accuracy`` is not a function.
    """
    return _check_one(_EXERCISES["exact_accuracy"], (exact_accuracy,), timeout)


def check_accumulation(accumulate: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check gradient accumulation under DDP: the big batch's gradients, one all-reduce a step.

    The exercise: write ``accumulate(model, optimizer, micro_batches, k) -> None``. ``model``
    is DDP-wrapped, ``micro_batches`` a list of this rank's ``(x, y)`` pairs (all of one size),
    the loss ``F.mse_loss(model(x), y)``. Train through the list in windows of ``k``
    micro-batches (the last window may hold fewer) with one ``optimizer.step()`` and
    ``optimizer.zero_grad()`` per window, so that each step uses the gradient of the window's
    samples from all ranks as one batch, and so that DDP all-reduces once per step.

    The checker runs it on 2 ranks, compares the gradients at every step with one process on
    the global batch, and counts the all-reduces with a DDP communication hook.

    Args:
        accumulate: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``accumulate`` is not a function.
    """
    return _check_one(_EXERCISES["accumulate"], (accumulate,), timeout)


def check_snapshot(
    save_snapshot: Callable[..., Any],
    load_snapshot: Callable[..., Any],
    *,
    timeout: float = 20.0,
) -> CheckResult:
    """Check a snapshot that lets a restarted job continue exactly where it stopped.

    The exercise: write ``save_snapshot(path, job) -> None`` and ``load_snapshot(path, job) ->
    None``. ``job`` is a :class:`TrainingJob` (``model``, a DDP model; ``optimizer``, Adam;
    ``scheduler``, a cosine schedule; ``sampler``; ``epoch``, the next epoch to train). The
    training loop adds random noise to every batch, drawn from torch's generator, which each
    rank seeds differently. Both functions are called on every rank with the same ``path``;
    ``load_snapshot`` must restore ``job`` in place, ``job.epoch`` included.

    The checker trains 2 ranks for one epoch, calls ``save_snapshot``, trains the next epoch
    (the uninterrupted run), then restarts: a new process group, a fresh job built and seeded
    as a restarted script would, ``load_snapshot``, and the same epoch again. Its losses and
    weights must equal the uninterrupted run's, bit for bit.

    Args:
        save_snapshot: your function that saves.
        load_snapshot: your function that restores.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: either argument is not a function.
    """
    return _check_one(_EXERCISES["snapshot"], (save_snapshot, load_snapshot), timeout)


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
    return _check_one(_EXERCISES["global_batch_stats"], (global_batch_stats,), timeout)


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
    return _check_one(_EXERCISES["checked_all_reduce"], (checked_all_reduce,), timeout)


def check_bytes_per_rank(
    bytes_per_rank: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check a memory calculator for Adam in float32 under DDP, ZeRO-1 and FSDP.

    The exercise: write ``bytes_per_rank(n_params, world_size, strategy) -> list[int]``: for a
    model whose parameters are one 1-d float32 tensor of ``n_params`` elements, trained with
    Adam, the bytes each rank holds for parameters (4 per element), gradients (4) and Adam's
    two moments (8), in rank order, under ``"ddp"``, ``"zero1"`` (the best case of
    ``ZeroRedundancyOptimizer``: Adam's state split evenly by element, the first
    ``n_params % world_size`` ranks one more, as :func:`mgtutor.memplan.estimate` assumes for a
    count) and ``"fsdp"`` (``fully_shard``: ``torch.chunk`` shards padded to the first one's
    size). DDP's buckets, Adam's step counters and activations are left out.

    The checker compares with :func:`mgtutor.memplan.estimate` (torch 2.14's rules) on six
    cases, one of them with more ranks than some shards have elements.

    Args:
        bytes_per_rank: your function.
        timeout: seconds the rank may take before it is stopped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``bytes_per_rank`` is not a function.
    """
    return _check_one(_EXERCISES["bytes_per_rank"], (bytes_per_rank,), timeout)


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
    return _check_one(_EXERCISES["assign_buckets"], (assign_buckets,), timeout)


def _check_one(exercise: _Exercise, functions: tuple, timeout: float) -> CheckResult:
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
    (result,) = _check(exercise, [functions], timeout)
    if result.status == NOT_ATTEMPTED:
        return _not_attempted(exercise, result.message)
    return result


def _not_attempted(exercise: _Exercise, why: str) -> CheckResult:
    from mgtutor import _solutions

    reference = tuple(getattr(_solutions, name) for name in exercise.functions)
    (result,) = _check(exercise, [reference], timeout=120.0, label="reference solution")
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


def _check(
    exercise: _Exercise | str,
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
        exercise: the exercise (or its key in ``_EXERCISES``: "ring_average",
            "exact_accuracy", "accumulate", "snapshot", "global_batch_stats",
            "checked_all_reduce", "bytes_per_rank", "assign_buckets").
        candidates: tuples of the functions the exercise takes.
        timeout: seconds per launch, from when every rank started.
        label: added to each result's name ("reference solution").

    Returns:
        One :class:`CheckResult` per candidate, in order.
    """
    import cloudpickle

    from mgtutor.launch import launch

    if isinstance(exercise, str):
        exercise = _EXERCISES[exercise]
    name = f"{exercise.name} ({label})" if label else exercise.name
    results: dict[int, CheckResult] = {}
    pending = list(range(len(candidates)))
    while pending:
        payloads = []
        for i in list(pending):
            try:
                payloads.append(cloudpickle.dumps(tuple(candidates[i])))
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
                _key(exercise),
                payloads,
                folder,
                world_size=exercise.world_size,
                backend="gloo",
                timeout=timeout,
            )
        except WorkerTimeout as exc:
            if len(pending) > 1:
                for i in pending:
                    (results[i],) = _check(exercise, [candidates[i]], timeout, label)
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
                    (results[i],) = _check(exercise, [candidates[i]], timeout, label)
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


def _key(exercise: _Exercise) -> str:
    return next(key for key, value in _EXERCISES.items() if value is exercise)


def _verdict(name: str, exercise: _Exercise, findings: list[list[dict]]) -> CheckResult:
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


def _raised(name: str, exercise: _Exercise, failure: LearnerFailed) -> CheckResult:
    common = {"cases": exercise.cases, "world_size": exercise.world_size}
    where = f"Case {failure.case!r}, rank {failure.rank}"
    if failure.exc_type == "NotImplementedError":
        return CheckResult(
            name,
            NOT_ATTEMPTED,
            f"{' or '.join(exercise.functions)} raised NotImplementedError",
            **common,
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
        **common,
    )


def _hung(name: str, exercise: _Exercise, exc: WorkerTimeout, timeout: float) -> CheckResult:
    lines = [
        f"Did not finish within {timeout:g} s; rank(s) {exc.running} were still running and "
        f"were stopped."
    ]
    for rank in exc.running:
        stack = (exc.stacks.get(rank) or "").splitlines()
        # The frames above the checker's call of the learner's function are the learner's.
        inside = next(
            (i for i, line in enumerate(stack) if "_exercise_cases" in line and "_call" in line),
            None,
        )
        if not stack:
            lines.append(f"Rank {rank}: no stack came back.")
        elif inside is None:
            lines.append(
                f"Rank {rank} was not in your function: it had returned (or not "
                f"started it) and waited for the other ranks."
            )
        else:
            lines += [f"Where rank {rank} was waiting (innermost call first):", *stack[:inside]]
    return CheckResult(
        name,
        FAILED,
        "\n".join(lines),
        hint=exercise.hang_hint + ".",
        cases=exercise.cases,
        world_size=exercise.world_size,
    )


def _crashed(name: str, exercise: _Exercise, exc: WorkerError) -> CheckResult:
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
