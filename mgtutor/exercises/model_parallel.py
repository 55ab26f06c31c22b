"""The checkers of the model-parallel notebooks' exercises (13 on)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mgtutor.exercises.catalogue import EXERCISES
from mgtutor.exercises.checking import CheckResult, _check_one

__all__ = [
    "check_tensor_parallel_pair",
    "check_merge_partials",
    "check_gpipe_step",
    "check_expert_dispatch",
]


def check_tensor_parallel_pair(
    copy_to_parallel: Callable[..., Any],
    reduce_from_parallel: Callable[..., Any],
    *,
    timeout: float = 20.0,
) -> CheckResult:
    """Check Megatron-LM's f and g, the conjugate pair around a tensor-parallel region.

    The exercise: write ``copy_to_parallel(x)`` (f: x unchanged in forward, its gradient
    all-reduced in backward) and ``reduce_from_parallel(x)`` (g: x all-reduced in forward, the
    gradient unchanged in backward), each returning ``SomeFunction.apply(x)`` of a
    ``torch.autograd.Function`` you write.

    The checker runs them on 2 ranks: each function alone, forward and backward, with a
    different input and a different upstream gradient on each rank; then an MLP split
    column-wise (the up layer's rows) then row-wise (the down layer's columns) with ``f``
    before it and ``g`` after it, whose output and every gradient must equal the same MLP in
    one process. It recognizes an all-reduce in both directions, none at all, a sum where a
    copy belongs, and a mean where a sum belongs.

    Args:
        copy_to_parallel: your f.
        reduce_from_parallel: your g.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: either argument is not a function.
    """
    return _check_one(
        EXERCISES["tensor_parallel_pair"], (copy_to_parallel, reduce_from_parallel), timeout
    )


def check_merge_partials(
    merge_partials: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check the log-sum-exp merge of two partial attention results, as ring attention needs.

    The exercise: write ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)``.
    ``out_a`` ``(..., L, D)`` is the attention of L queries over block a of the keys alone, and
    ``lse_a`` ``(..., L)`` the log of each row's softmax normalizer over that block; the same for
    block b. Return the attention over both blocks and its log-sum-exp, with no overflow for
    large scores, and with rows that no key reached (``lse`` ``-inf`` in both) left at 0 and
    ``-inf``.

    The checker compares with attention over both blocks on five cases (blocks of equal and
    unequal size, scores near 1,000, a fully masked block, rows that see nothing), then runs
    :func:`mgtutor.parallel.context.ring_attention` with your merge on 2 ranks, causal, against
    full attention.

    Args:
        merge_partials: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``merge_partials`` is not a function.
    """
    return _check_one(EXERCISES["merge_partials"], (merge_partials,), timeout)


def check_gpipe_step(gpipe_step: Callable[..., Any], *, timeout: float = 30.0) -> CheckResult:
    """Check one GPipe step of a pipeline stage built from send and recv, as in notebook 15.

    The exercise: write ``gpipe_step(stage_module, micro_batches, targets, loss_fn) -> None``.
    Rank r holds stage r (``stage_module``); every rank gets the same micro-batches and
    targets. Stage 0 feeds the micro-batches through its layer; every other stage receives
    each activation from rank r - 1 (it has a micro-batch's shape) and sends its output on;
    the last stage computes ``loss_fn(output, target)``. Then every micro-batch backward, the
    gradient of each stage's input sent back to rank r - 1. The step's loss is the sum of the
    micro-batches' losses; the gradients are left in the stage's ``.grad``.

    The checker runs it on 3 ranks (so one stage both receives and sends each way) with 4, 1
    and 6 micro-batches, counts the messages each rank sends and receives (one activation and
    one gradient per micro-batch at each boundary) and compares each stage's gradients with
    the whole model's in one process.

    Args:
        gpipe_step: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``gpipe_step`` is not a function.
    """
    return _check_one(EXERCISES["gpipe_step"], (gpipe_step,), timeout)


def check_expert_dispatch(
    plan_dispatch: Callable[..., Any], *, timeout: float = 30.0
) -> CheckResult:
    """Check the dispatch plan of a mixture of experts whose experts are spread across ranks.

    The exercise: write ``plan_dispatch(experts, keep, experts_per_rank, world) -> (order,
    per_expert, send)``. ``experts`` ``[tokens, k]`` holds each token's chosen experts, ``keep``
    (same shape) whether each assignment fits in its expert's capacity. Return the kept
    assignments' flat indices (``token * k + choice``) sorted by expert, the number for each
    expert, and the rows for each rank (the ``input_split_sizes`` of ``all_to_all_single``).

    The checker runs it on 2 ranks (4 experts, 2 each) inside
    :class:`mgtutor.parallel.expert.ExpertParallelMoE`, with no capacity, with capacity factor
    1.0, and with no token choosing rank 1's experts, against one process. It recognizes counts
    per expert where counts per rank belong, splits in reverse rank order, assignments not
    grouped by expert, dropped assignments sent, and ``bincount`` without ``minlength``.

    Args:
        plan_dispatch: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``plan_dispatch`` is not a function.
    """
    return _check_one(EXERCISES["expert_dispatch"], (plan_dispatch,), timeout)
