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
:mod:`mgtutor.exercises.solutions`; read them once yours passes). A function that raises is reported
with the rank and its traceback; one that hangs is stopped after ``timeout`` seconds and
reported with where each rank was waiting.

The checkers: :func:`check_ring_average` (notebook 02), :func:`check_exact_accuracy` (03),
:func:`check_global_batch_stats` (04), :func:`check_accumulation` (05),
:func:`check_shard_indices` (06), :func:`check_buckets` (07),
:func:`check_serial_fraction` (08), :func:`check_snapshot` (09),
:func:`check_checked_all_reduce` (10), :func:`check_find_drifted` (11),
:func:`check_bytes_per_rank` (12), :func:`check_tensor_parallel_pair` (13),
:func:`check_merge_partials` (14), :func:`check_gpipe_step` (15),
:func:`check_expert_dispatch` (16).

Where things are: one module per exercise, named by its key (:mod:`.ring_average`,
:mod:`.accumulate`, ... :mod:`.expert_dispatch`), each holding its ``check_*`` function, its
cases, what every rank runs for them, the diagnosis of each failure, and its ``EXERCISE``
record (hints, and a pointer to its reference solution in :mod:`.solutions`). What they share:
:mod:`.checking` (the notebook's side: recognize a stub, launch, judge), :mod:`.rank_side`
(inside a rank: call the learner's function, compare, report) and :mod:`.check_result` (the
:class:`CheckResult` a notebook shows).
"""

from __future__ import annotations

from collections.abc import Sequence

from mgtutor.exercises import (
    accumulate,
    assign_buckets,
    bytes_per_rank,
    checked_all_reduce,
    exact_accuracy,
    expert_dispatch,
    find_drifted,
    global_batch_stats,
    gpipe_step,
    merge_partials,
    ring_average,
    serial_fraction,
    shard_indices,
    snapshot,
    tensor_parallel_pair,
)
from mgtutor.exercises.accumulate import check_accumulation
from mgtutor.exercises.assign_buckets import check_buckets
from mgtutor.exercises.bytes_per_rank import check_bytes_per_rank
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checked_all_reduce import check_checked_all_reduce
from mgtutor.exercises.checking import Exercise, check_all
from mgtutor.exercises.exact_accuracy import check_exact_accuracy
from mgtutor.exercises.expert_dispatch import check_expert_dispatch
from mgtutor.exercises.find_drifted import check_find_drifted
from mgtutor.exercises.global_batch_stats import check_global_batch_stats
from mgtutor.exercises.gpipe_step import check_gpipe_step
from mgtutor.exercises.merge_partials import check_merge_partials
from mgtutor.exercises.ring_average import check_ring_average
from mgtutor.exercises.serial_fraction import check_serial_fraction
from mgtutor.exercises.shard_indices import check_shard_indices
from mgtutor.exercises.snapshot import TrainingJob, check_snapshot
from mgtutor.exercises.tensor_parallel_pair import check_tensor_parallel_pair

__all__ = [
    "CheckResult",
    "TrainingJob",
    "check_accumulation",
    "check_buckets",
    "check_bytes_per_rank",
    "check_checked_all_reduce",
    "check_exact_accuracy",
    "check_find_drifted",
    "check_global_batch_stats",
    "check_gpipe_step",
    "check_merge_partials",
    "check_ring_average",
    "check_serial_fraction",
    "check_shard_indices",
    "check_snapshot",
    "check_tensor_parallel_pair",
]
__all__ += ["check_expert_dispatch"]

#: Every exercise by its key (the name of its module): ``EXERCISES["accumulate"]``.
EXERCISES: dict[str, Exercise] = {
    module.EXERCISE.key: module.EXERCISE
    for module in (
        ring_average,
        exact_accuracy,
        global_batch_stats,
        accumulate,
        shard_indices,
        assign_buckets,
        serial_fraction,
        snapshot,
        checked_all_reduce,
        find_drifted,
        bytes_per_rank,
        tensor_parallel_pair,
        merge_partials,
        gpipe_step,
        expert_dispatch,
    )
}


def _check(
    exercise: Exercise | str,
    candidates: Sequence[tuple],
    timeout: float = 20.0,
    label: str = "",
) -> list[CheckResult]:
    """Run several candidates through one exercise, in as few launches as possible.

    The tests use this to check many wrong answers for the price of one launch; see
    :func:`mgtutor.exercises.checking.check_all`.

    Args:
        exercise: the exercise, or its key in :data:`EXERCISES`
            ("ring_average", "gpipe_step", ...).
        candidates: tuples of the functions the exercise takes.
        timeout: seconds per launch, from when every rank started.
        label: added to each result's name ("reference solution").

    Returns:
        One :class:`CheckResult` per candidate, in order.
    """
    if isinstance(exercise, str):
        exercise = EXERCISES[exercise]
    return check_all(exercise, candidates, timeout, label)
