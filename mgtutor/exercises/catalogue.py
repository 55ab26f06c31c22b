"""What each exercise is: its function's name, ranks, cases, and the hints for its failures.

One :class:`~mgtutor.exercises.checking._Exercise` record per exercise, keyed as the tests and
:func:`mgtutor.exercises._check` name it; the ``check_*`` functions look theirs up here.
"""

from __future__ import annotations

from mgtutor.exercises.cases import (
    ACCUMULATION_CASES,
    ACCURACY_CASES,
    BATCH_STATS_CASES,
    BUCKET_CASES,
    BYTES_CASES,
    CHECKED_CASES,
    DISPATCH_CASES,
    DRIFT_CASES,
    GPIPE_CASES,
    MERGE_CASES,
    PAIR_CASES,
    RING_CASES,
    SCALING_CASES,
    SHARD_CASES,
)
from mgtutor.exercises.checking import _Exercise

__all__ = ["EXERCISES"]

EXERCISES = {
    exercise.key: exercise
    for exercise in (
        _Exercise(
            "ring_average",
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
        _Exercise(
            "exact_accuracy",
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
        _Exercise(
            "accumulate",
            "accumulate",
            ("accumulate",),
            2,
            tuple(case for case, _, _ in ACCUMULATION_CASES),
            "the ranks must run the same number of backward passes outside no_sync: each one "
            "all-reduces, and a rank that skips one leaves the others waiting",
        ),
        _Exercise(
            "snapshot",
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
        _Exercise(
            "global_batch_stats",
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
        _Exercise(
            "checked_all_reduce",
            "checked_all_reduce",
            ("checked_all_reduce",),
            2,
            tuple(case for case, _, _ in CHECKED_CASES),
            "the ranks' collectives did not pair up: one rank waits in a collective that "
            "another never calls. Gather the shapes on every rank with the same call, decide on "
            "every rank, and either raise on all of them or all-reduce on all of them",
        ),
        _Exercise(
            "bytes_per_rank",
            "bytes_per_rank",
            ("bytes_per_rank",),
            1,
            tuple(case for case, *_ in BYTES_CASES),
            "the function does not return: it computes a few numbers, with no collective and "
            "no loop over the parameters",
        ),
        _Exercise(
            "assign_buckets",
            "assign_buckets",
            ("assign_buckets",),
            2,
            tuple(case for case, *_ in BUCKET_CASES),
            "the function does not return: it needs no collective, only one pass over the sizes",
        ),
        _Exercise(
            "shard_indices",
            "shard_indices",
            ("shard_indices",),
            2,
            tuple(case for case, *_ in SHARD_CASES),
            "the function does not return: it needs no collective and no loop that waits, only "
            "arithmetic on its five arguments",
        ),
        _Exercise(
            "serial_fraction",
            "serial_fraction",
            ("serial_fraction",),
            1,
            tuple(case for case, *_ in SCALING_CASES),
            "the function does not return: it needs no collective and no loop, only a speedup and "
            "one of the two laws turned around",
        ),
        _Exercise(
            "find_drifted",
            "find_drifted",
            ("find_drifted",),
            3,
            tuple(case for case, *_ in DRIFT_CASES),
            "a collective that not every rank calls waits forever: call the same collectives on "
            "every rank, rank 0 included, whatever its own verdict",
        ),
        _Exercise(
            "tensor_parallel_pair",
            "copy_to_parallel / reduce_from_parallel",
            ("copy_to_parallel", "reduce_from_parallel"),
            2,
            PAIR_CASES,
            "a collective that not every rank calls waits forever: each function's all-reduce "
            "runs on every rank, with no condition on the rank",
        ),
        _Exercise(
            "merge_partials",
            "merge_partials",
            ("merge_partials",),
            2,
            tuple(case for case, *_ in MERGE_CASES),
            "the function does not return: it needs no collective and no loop, a few tensor "
            "operations on its four arguments",
        ),
        _Exercise(
            "gpipe_step",
            "gpipe_step",
            ("gpipe_step",),
            3,
            tuple(case for case, *_ in GPIPE_CASES),
            "a recv that no send matches waits forever: stage r receives activations from rank "
            "r - 1 and gradients from rank r + 1, as many of each as there are micro-batches; "
            "the first stage receives no activation and the last no gradient",
            {
                "TypeError": "a send of None (got <class 'NoneType'>) is the gradient of a "
                "received activation that did not require grad: call x.requires_grad_(True) "
                "after the recv, or backward leaves x.grad as None and there is nothing to send "
                "back",
            },
        ),
        _Exercise(
            "expert_dispatch",
            "plan_dispatch",
            ("plan_dispatch",),
            2,
            tuple(case for case, *_ in DISPATCH_CASES),
            "the function does not return: it needs no collective and no loop over ranks, a "
            "sort and two counts of the router's choices",
        ),
    )
}
