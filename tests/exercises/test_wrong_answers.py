"""Each checker passes its reference solution and names what is wrong in a plausible mistake.

One table of (exercise, wrong functions, words the result must show). An exercise's rows run
in one launch, with its reference solution first (``exercises._check`` takes several
candidates), so the table costs one launch per exercise, whatever its number of rows.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import pytest
import torch

from mgtutor import exercises
from mgtutor.build import torch_release
from mgtutor.exercises import CheckResult, shard_indices, solutions
from tests.exercises import wrong_answers as w

# The checkers serve the notebooks, which run on the newest torch only: not run on the floor.
# (The snapshot checker's hangs once seen there were torch's destroy-time GIL deadlock, which
# mgtutor.worker.keep_destroyed_groups now avoids.)
pytestmark = pytest.mark.skipif(
    torch_release() < (2, 6),
    reason=f"the exercises run with the notebooks' torch (>= 2.6), not {torch.__version__}",
)


class Row(NamedTuple):
    exercise: str  # its key: the module mgtutor.exercises.<exercise>
    functions: tuple[Any, ...]  # the candidate, one function per function of the exercise
    words: tuple[str, ...]  # in the message or the hint, in any case
    hint: str = ""  # in the hint, exactly


f, g = solutions.copy_to_parallel, solutions.reduce_from_parallel
TABLE = [
    # notebook 02
    Row("ring_average", (w.ring_sum,), ("3 times the mean", "divide by the world size")),
    Row("ring_average", (w.ring_off_by_one_piece,), ("piece", "reduce-scatter")),
    Row("ring_average", (w.ring_by_all_reduce,), ("dist.all_reduce", "point-to-point")),
    Row("ring_average", (w.ring_returns_a_copy,), ("unchanged", "in place")),
    # notebook 03
    Row("exact_accuracy", (w.accuracy_with_repeats,), ("padded repeats",)),
    Row("exact_accuracy", (w.accuracy_of_this_rank,), ("this rank's own figure",)),
    Row("exact_accuracy", (w.accuracy_mean_of_means,), ("mean of the ranks' accuracies",)),
    Row("exact_accuracy", (w.accuracy_drops_the_last_ranks_last,), ("count each index",)),
    # notebook 04
    Row(
        "global_batch_stats",
        (w.stats_mean_of_means,),
        ("6 and 2", "the mean of the ranks' means", "counts"),
    ),
    Row(
        "global_batch_stats",
        (w.stats_mean_of_variances,),
        ("4 and 4", "mean of the ranks' variances", "spread"),
    ),
    Row("global_batch_stats", (w.stats_weighted_variances,), ("4 and 4", "spread between")),
    Row("global_batch_stats", (w.stats_unbiased,), ("4 and 4", "unbiased", "correction=0")),
    Row(
        "global_batch_stats",
        (w.stats_without_counts,),
        ("6 and 2", "this rank's count", "all-reduce the count"),
    ),
    # notebook 05
    Row(
        "accumulate",
        (w.accumulate_without_no_sync,),
        ("all-reduced the gradients 8 time(s)", "forward and the backward"),
    ),
    Row(
        "accumulate",
        (w.accumulate_no_sync_around_backward,),
        ("8 time(s)", "forward and the backward"),
    ),
    Row("accumulate", (w.accumulate_undivided,), ("4 times too large", "divide each")),
    Row(
        "accumulate",
        (w.accumulate_divided_by_k,),
        ("windows of 2, 2 and 1", "1/2 of what", "holds 1"),
    ),
    Row(
        "accumulate", (w.accumulate_no_last_step,), ("ran 2 time(s)", "step after the last window")
    ),
    Row("accumulate", (w.accumulate_no_zero_grad,), ("previous window", "zero_grad")),
    # notebook 06
    Row(
        "shard_indices",
        (w.shards_by_rank_only,),
        ("rank 0's worker 1", "whole shard", "by rank only"),
    ),
    Row("shard_indices", (w.shards_by_worker_only,), ("rank 1's worker 0", "by worker only")),
    Row(
        "shard_indices",
        (w.shards_rounded_down,),
        ("read by nobody: [8, 9], the last ones", "left over"),
    ),
    Row(
        "shard_indices",
        (w.shards_worker_major,),
        ("rank 0 read 6, rank 1 read 4", "rank * num_workers + worker_id"),
    ),
    Row("shard_indices", (w.shards_nothing,), ("every worker of every rank", "nothing is split")),
    Row(
        "shard_indices", (w.shards_one_past_the_end,), ("sample 10 was read, which does not exist",)
    ),
    Row("shard_indices", (w.shards_a_count,), ("returned int", "a list of ints")),
    Row(
        "shard_indices",
        (w.shards_unpadded,),
        ("11 samples", "different batch counts: rank 0 4, rank 1 3", "pad"),
    ),
    Row(
        "shard_indices",
        (w.shards_padded_with_the_last,),
        ("11 samples", "[10] again", "padding reads [0] again", "the first samples again"),
    ),
    # notebook 07
    Row("assign_buckets", (w.buckets_in_forward_order,), ("forward order", "in reverse")),
    Row(
        "assign_buckets",
        (w.buckets_without_a_first_cap,),
        ("unset", "capped at cap_bytes", "first_cap_bytes"),
    ),
    Row(
        "assign_buckets",
        (w.buckets_never_over_the_cap,),
        ("would pass the cap", "larger than its cap"),
    ),
    # notebook 08
    Row(
        "serial_fraction",
        (w.serial_by_amdahl_always,),
        ("weak, 4 ranks", "time ratio, read with amdahl"),
    ),
    Row(
        "serial_fraction",
        (w.serial_by_amdahl_for_weak,),
        ("weak, 4 ranks", "amdahl's law", "read with gustafson's"),
    ),
    Row(
        "serial_fraction",
        (w.serial_weak_time_ratio,),
        ("weak, 4 ranks", "n x t1 / tn, not t1 / tn"),
    ),
    Row(
        "serial_fraction",
        (w.serial_parallel_fraction,),
        ("strong, 4 ranks", "returned 0.9", "parallel fraction"),
    ),
    Row(
        "serial_fraction",
        (w.serial_clipped,),
        ("slower than 1", "returned 1, expected 1.4", "do not clip"),
    ),
    Row("serial_fraction", (w.serial_speedup,), ("strong, 4 ranks", "that is the speedup")),
    # notebook 09
    Row(
        "snapshot",
        (w.save_without_rng, w.load_everything),
        ("was not restored", "torch.get_rng_state"),
    ),
    Row("snapshot", (w.save_rank_0_rng, w.load_everything), ("rank 1 restored rank 0's",)),
    Row(
        "snapshot",
        (solutions.save_snapshot, w.load_without_scheduler),
        ("scheduler differs", "scheduler.state_dict"),
    ),
    Row("snapshot", (solutions.save_snapshot, w.load_without_epoch), ("job.epoch is 0",)),
    # notebook 10
    Row(
        "checked_all_reduce",
        (w.reduce_unchecked,),
        ("(2, 3) on rank 0", "rank 0: all_reduce of (2, 3)", "not enough"),
    ),
    Row(
        "checked_all_reduce",
        (w.reduce_checking_shapes_only,),
        ("float64 on rank 1", "compare the dtypes"),
    ),
    Row(
        "checked_all_reduce",
        (w.reduce_with_a_vague_message,),
        ("name every rank", "here rank 0 (2, 3), rank 1 (3, 2)"),
    ),
    Row(
        "checked_all_reduce",
        (w.reduce_checked_on_rank_0,),
        ("rank 1: rank 1 went on to dist.all_reduce", "rank 0 had left", "every rank"),
    ),
    Row(
        "checked_all_reduce",
        (w.reduce_gathering_shape_tensors,),
        ("0-d on rank 0", "own dist.all_gather", "length 0"),
    ),
    Row("checked_all_reduce", (w.reduce_asserting,), ("raised AssertionError", "raise ValueError")),
    # notebook 11
    Row(
        "find_drifted",
        (w.drifted_exactly,),
        ("last bit", "returned [1], expected []", "with a tolerance"),
    ),
    Row(
        "find_drifted",
        (w.drifted_by_checksum,),
        ("swapped", "same sum", "element by element"),
    ),
    Row(
        "find_drifted",
        (w.drifted_locally,),
        ("rank 0: returned [], expected [2]", "share the verdicts"),
    ),
    Row("find_drifted", (w.drifted_on_rank_0_only,), ("rank 1: returned None", "not only rank 0")),
    Row(
        "find_drifted",
        (w.drifted_from_the_mean,),
        ("rank 0 is in the list", "not the majority or the mean"),
    ),
    Row("find_drifted", (w.drifted_broadcast_in_place,), ("parameters changed", "into a copy")),
    # notebook 12
    Row("bytes_per_rank", (w.bytes_with_buckets,), ("4 ranks, ddp", "buckets")),
    Row(
        "bytes_per_rank",
        (w.bytes_zero1_shards_everything,),
        ("1,000 parameters, 4 ranks, zero1", "only the optimizer"),
    ),
    Row(
        "bytes_per_rank",
        (w.bytes_zero1_rounded_down,),
        ("1,001", "rounding its share down", "one more"),
    ),
    Row("bytes_per_rank", (w.bytes_fsdp_unpadded,), ("10 parameters", "unpadded", "pads")),
    Row("bytes_per_rank", (w.bytes_fsdp_padded_state,), ("10 parameters", "zeros_like")),
    Row("bytes_per_rank", (w.bytes_one_number,), ("returned int", "a list of 4 numbers")),
    # notebook 13
    Row(
        "tensor_parallel_pair",
        (w.pair_all_reduce_both, g),  # f sums where it should copy
        ("copy_to_parallel's forward", "all-reduces where it should copy"),
    ),
    Row(
        "tensor_parallel_pair",
        (f, w.pair_all_reduce_both),  # g all-reduces in both directions
        ("reduce_from_parallel's backward", "both directions"),
    ),
    Row(
        "tensor_parallel_pair",
        (w.pair_no_collective, g),  # f never all-reduces
        ("copy_to_parallel's backward", "does not all-reduce"),
    ),
    Row(
        "tensor_parallel_pair",
        (f, w.pair_no_collective),  # g never all-reduces
        ("reduce_from_parallel's forward", "does not all-reduce"),
    ),
    Row(
        "tensor_parallel_pair",
        (g, f),  # the two swapped
        ("copy_to_parallel's forward", "sum over the ranks"),
    ),
    Row("tensor_parallel_pair", (f, w.pair_mean), ("mean over the ranks", "do not average")),
    Row(
        "tensor_parallel_pair",
        (f, w.pair_plain_all_reduce),
        ("reduce_from_parallel's backward", "autograd.Function"),
    ),
    # notebook 14
    Row(
        "merge_partials",
        (w.merge_average,),
        ("keys 0-5", "the average of the two outputs", "exp(lse_part"),
    ),
    Row("merge_partials", (w.merge_not_rescaled,), ("keys 0-5", "not rescaled", "add up to 1")),
    Row(
        "merge_partials",
        (w.merge_lse_by_max,),
        ("keys 0-5", "out right, lse wrong", "not their maximum"),
    ),
    Row("merge_partials", (w.merge_naive_exp,), ("near 1,000", "inf", "never exponentiate an lse")),
    Row(
        "merge_partials",
        (w.merge_without_inf_guard,),
        ("rows 0-1", "both -inf", "-inf - (-inf) is nan"),
    ),
    Row(
        "merge_partials",
        (w.merge_returns_out_only,),
        ("returned one tensor", "return a pair (out, lse)"),
    ),
    # notebook 15
    Row(
        "gpipe_step",
        (w.gpipe_mean_of_micro_batch_losses,),
        ("4 micro-batches", "divided by 4", "scale_grads"),
    ),
    Row(
        "gpipe_step",
        (w.gpipe_zero_grad_per_micro_batch,),
        ("4 micro-batches", "last micro-batch alone", "add up"),
    ),
    Row(
        "gpipe_step",
        (w.gpipe_whole_batch_at_once,),
        ("4 micro-batches", "1 message(s), expected 4"),
    ),
    Row("gpipe_step", (w.gpipe_input_without_grad,), (), hint="requires_grad_(True)"),
    # notebook 16
    Row(
        "expert_dispatch",
        (w.plan_send_per_expert,),
        ("24 tokens", "4 counts, one per expert", "sum per_expert"),
    ),
    Row(
        "expert_dispatch",
        (w.plan_reversed_splits,),
        ("24 tokens", "reverse rank order", "rank 0 first"),
    ),
    Row(
        "expert_dispatch",
        (w.plan_unsorted,),
        ("24 tokens", "not grouped by expert", "consecutive blocks"),
    ),
    Row(
        "expert_dispatch",
        (w.plan_sorted_by_rank_only,),
        ("24 tokens", "by rank, but mixed within a rank"),
    ),
    Row(
        "expert_dispatch", (w.plan_ignoring_capacity,), ("capacity factor 1.0", "marks as dropped")
    ),
    Row("expert_dispatch", (w.plan_without_minlength,), ("no token chooses", "minlength")),
]
# Seconds per launch; 20 for the others. shard_indices' loaders may start a forkserver in each
# rank, which imports torch first (mgtutor.build.loader_start_method).
TIMEOUTS = {"gpipe_step": 30.0, "shard_indices": shard_indices.default_timeout()}


@functools.cache
def _results(exercise: str) -> tuple[CheckResult, ...]:
    """The reference's result, then each of the exercise's rows', from one launch."""
    candidates = [exercises.EXERCISES[exercise].reference]
    candidates += [row.functions for row in TABLE if row.exercise == exercise]
    return tuple(exercises._check(exercise, candidates, timeout=TIMEOUTS.get(exercise, 20.0)))


def _row_id(row: Row) -> str:
    return f"{row.exercise}-" + "-".join(fn.__name__ for fn in row.functions)


def test_every_exercise_has_rows() -> None:
    assert {row.exercise for row in TABLE} == set(exercises.EXERCISES)


@pytest.mark.parametrize("exercise", sorted({row.exercise for row in TABLE}))
def test_the_reference_solution_passes(exercise: str) -> None:
    reference = _results(exercise)[0]
    assert reference.passed, reference


@pytest.mark.parametrize("row", TABLE, ids=_row_id)
def test_a_wrong_answer_gets_its_message(row: Row) -> None:
    position = [r for r in TABLE if r.exercise == row.exercise].index(row)
    result = _results(row.exercise)[1 + position]
    text = f"{result.message} {result.hint}".lower()
    assert result.status == "failed", result
    assert all(word.lower() in text for word in row.words), result
    assert row.hint in result.hint, result
