"""What the exercise checks run inside each rank: the cases, the learner's call, the diagnosis.

:mod:`mgtutor.exercises` launches :func:`run_candidates` on CPU ranks. For every candidate (a
learner's function, or a tuple of them) it builds each case's inputs the same way on every
rank, calls the candidate, and compares what came out with what must come out. The expected
result never comes from a collective: each rank computes it from all ranks' inputs, or reads it
from torch itself (the buckets DDP built, memplan's rules), so a wrong answer cannot hide behind
a reference that shares its mistake (the checker's own collectives only let the ranks agree to
stop at the first failing case). Each case yields a finding,
``{"case", "ok", "detail", "hint", "knock_on"}``; the notebook's process turns the first
failing one into the verdict.

A candidate that raises is reported as :class:`LearnerFailed`, carrying which candidate, which
case, which rank, and the learner's own part of the traceback.

One module per exercise (its cases, its runner ``run`` and its diagnosis), named after it;
:mod:`._common` holds what they share.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from mgtutor.exercises.cases import (
    accumulation,
    accuracy,
    batch_stats,
    buckets,
    bytes_per_rank,
    checked_all_reduce,
    drift,
    expert_dispatch,
    merge_partials,
    pipeline,
    ring,
    scaling,
    shards,
    snapshot,
    tensor_pair,
)
from mgtutor.exercises.cases._common import Finding, LearnerFailed
from mgtutor.exercises.cases.accumulation import ACCUMULATION_CASES
from mgtutor.exercises.cases.accuracy import ACCURACY_CASES
from mgtutor.exercises.cases.batch_stats import BATCH_STATS_CASES
from mgtutor.exercises.cases.buckets import BUCKET_CASES
from mgtutor.exercises.cases.bytes_per_rank import BYTES_CASES
from mgtutor.exercises.cases.checked_all_reduce import CHECKED_CASES
from mgtutor.exercises.cases.drift import DRIFT_CASES
from mgtutor.exercises.cases.expert_dispatch import DISPATCH_CASES
from mgtutor.exercises.cases.merge_partials import MERGE_CASES
from mgtutor.exercises.cases.pipeline import GPIPE_CASES
from mgtutor.exercises.cases.ring import RING_CASES
from mgtutor.exercises.cases.scaling import SCALING_CASES
from mgtutor.exercises.cases.shards import SHARD_CASES
from mgtutor.exercises.cases.snapshot import SNAPSHOT_EPOCHS, TrainingJob
from mgtutor.exercises.cases.tensor_pair import PAIR_CASES

__all__ = [
    "ACCUMULATION_CASES",
    "ACCURACY_CASES",
    "BATCH_STATS_CASES",
    "BUCKET_CASES",
    "BYTES_CASES",
    "CHECKED_CASES",
    "DISPATCH_CASES",
    "DRIFT_CASES",
    "GPIPE_CASES",
    "EXERCISE_RUNNERS",
    "MERGE_CASES",
    "RING_CASES",
    "SCALING_CASES",
    "SHARD_CASES",
    "SNAPSHOT_EPOCHS",
    "Finding",
    "LearnerFailed",
    "PAIR_CASES",
    "TrainingJob",
    "run_candidates",
]

EXERCISE_RUNNERS: dict[str, Callable[[bytes, int, str | None], list[Finding]]] = {
    "ring_average": ring.run,
    "exact_accuracy": accuracy.run,
    "accumulate": accumulation.run,
    "snapshot": snapshot.run,
    "global_batch_stats": batch_stats.run,
    "checked_all_reduce": checked_all_reduce.run,
    "bytes_per_rank": bytes_per_rank.run,
    "assign_buckets": buckets.run,
    "shard_indices": shards.run,
    "serial_fraction": scaling.run,
    "find_drifted": drift.run,
    "merge_partials": merge_partials.run,
    "tensor_parallel_pair": tensor_pair.run,
    "gpipe_step": pipeline.run,
    "expert_dispatch": expert_dispatch.run,
}


def run_candidates(exercise: str, payloads: list[bytes], folder: str | None) -> list[list[Finding]]:
    """Run each pickled candidate through ``exercise``'s cases; one list of findings each.

    Args:
        exercise: a key of :data:`EXERCISE_RUNNERS`.
        payloads: cloudpickled tuples of the candidate's functions.
        folder: a scratch folder the exercise may write to (the snapshot's), or None.

    Returns:
        For each candidate, one finding per case, in order.

    Raises:
        LearnerFailed: a candidate raised; the candidates after it did not run.
    """
    from mgtutor.worker import setup

    setup(backend="gloo")
    runner = EXERCISE_RUNNERS[exercise]
    reports = []
    for index, payload in enumerate(payloads):
        reports.append(runner(payload, index, folder))
        dist.barrier()
    return reports
