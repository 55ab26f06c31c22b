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

Where things are: the checkers in :mod:`.data_parallel` and :mod:`.model_parallel`, what each
exercise is in :mod:`.catalogue`, its cases (run inside the ranks) in :mod:`.cases`, the
machinery that launches and judges them in :mod:`.checking`, and the reference solutions in
:mod:`.solutions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from mgtutor.exercises import checking as _checking
from mgtutor.exercises.cases import TrainingJob
from mgtutor.exercises.catalogue import EXERCISES as _EXERCISES
from mgtutor.exercises.checking import CheckResult, _Exercise
from mgtutor.exercises.data_parallel import (
    check_accumulation,
    check_buckets,
    check_bytes_per_rank,
    check_checked_all_reduce,
    check_exact_accuracy,
    check_find_drifted,
    check_global_batch_stats,
    check_ring_average,
    check_serial_fraction,
    check_shard_indices,
    check_snapshot,
)
from mgtutor.exercises.model_parallel import (
    check_expert_dispatch,
    check_gpipe_step,
    check_merge_partials,
    check_tensor_parallel_pair,
)

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


def _check(
    exercise: _Exercise | str,
    candidates: Sequence[tuple],
    timeout: float = 20.0,
    label: str = "",
) -> list[CheckResult]:
    """Run several candidates through one exercise, in as few launches as possible.

    The tests use this to check many wrong answers for the price of one launch; see
    :func:`mgtutor.exercises.checking._check`.

    Args:
        exercise: the exercise, or its key in :data:`.catalogue.EXERCISES`
            ("ring_average", "gpipe_step", ...).
        candidates: tuples of the functions the exercise takes.
        timeout: seconds per launch, from when every rank started.
        label: added to each result's name ("reference solution").

    Returns:
        One :class:`CheckResult` per candidate, in order.
    """
    if isinstance(exercise, str):
        exercise = _EXERCISES[exercise]
    return _checking._check(exercise, candidates, timeout, label)
