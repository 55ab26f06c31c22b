"""The checkers of the data-parallel notebooks' exercises (02 to 12)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mgtutor.exercises.catalogue import EXERCISES
from mgtutor.exercises.checking import CheckResult, _check_one

__all__ = [
    "check_ring_average",
    "check_exact_accuracy",
    "check_accumulation",
    "check_snapshot",
    "check_global_batch_stats",
    "check_checked_all_reduce",
    "check_bytes_per_rank",
    "check_buckets",
    "check_shard_indices",
    "check_serial_fraction",
    "check_find_drifted",
]


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
    return _check_one(EXERCISES["ring_average"], (ring_average,), timeout)


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
    return _check_one(EXERCISES["exact_accuracy"], (exact_accuracy,), timeout)


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
    return _check_one(EXERCISES["accumulate"], (accumulate,), timeout)


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
    return _check_one(EXERCISES["snapshot"], (save_snapshot, load_snapshot), timeout)


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
    return _check_one(EXERCISES["global_batch_stats"], (global_batch_stats,), timeout)


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
    return _check_one(EXERCISES["checked_all_reduce"], (checked_all_reduce,), timeout)


def check_bytes_per_rank(
    bytes_per_rank: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check a memory calculator for Adam in float32 under DDP, ZeRO-1 and FSDP.

    The exercise: write ``bytes_per_rank(n_params, world_size, strategy) -> list[int]``: for a
    model whose parameters are one 1-d float32 tensor of ``n_params`` elements, trained with
    Adam, the bytes each rank holds for parameters (4 per element), gradients (4) and Adam's
    two moments (8), in rank order, under ``"ddp"``, ``"zero1"`` (the best case of
    ``ZeroRedundancyOptimizer``: Adam's state split evenly by element, the first
    ``n_params % world_size`` ranks one more, as :func:`mgtutor.measure.memplan.estimate`
    assumes for a count) and ``"fsdp"`` (``fully_shard``: ``torch.chunk`` shards padded to the
    first one's size). DDP's buckets, Adam's step counters and activations are left out.

    The checker compares with :func:`mgtutor.measure.memplan.estimate` (torch 2.14's rules) on six
    cases, one of them with more ranks than some shards have elements.

    Args:
        bytes_per_rank: your function.
        timeout: seconds the rank may take before it is stopped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``bytes_per_rank`` is not a function.
    """
    return _check_one(EXERCISES["bytes_per_rank"], (bytes_per_rank,), timeout)


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
    return _check_one(EXERCISES["assign_buckets"], (assign_buckets,), timeout)


def check_shard_indices(shard_indices: Callable[..., Any], *, timeout: float = 30.0) -> CheckResult:
    """Check how a stream's samples are split between ranks and their DataLoader workers.

    The exercise: write ``shard_indices(n_samples, rank, world_size, worker_id, num_workers)
    -> list[int]``, the indices of the samples that DataLoader worker ``worker_id`` (of
    ``num_workers``) of rank ``rank`` (of ``world_size``) reads, for an ``IterableDataset``
    over samples ``0 .. n_samples - 1``: it runs once in every worker of every rank (with
    ``num_workers=0`` the loop itself reads: worker 0 of 1). Over all ranks and workers, every
    sample must be read, nothing dropped, and every rank must get the same number of batches
    (under DDP each rank runs a step per batch): every rank reads ceil(n_samples / world_size)
    samples, padded with the first samples again as DistributedSampler pads.

    The checker runs it on 2 ranks: each rank calls it for each of its workers, on sample
    counts that divide and that do not, fewer samples than readers and no workers; and twice
    through a real ``DataLoader`` (batches of 2, 2 forked workers on each rank), counting the
    batches each rank's loader yields. The ranks exchange what each worker read.

    Args:
        shard_indices: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``shard_indices`` is not a function.
    """
    return _check_one(EXERCISES["shard_indices"], (shard_indices,), timeout)


def check_serial_fraction(
    serial_fraction: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check the serial fraction that Amdahl's or Gustafson's law reads from a measured run.

    The exercise: write ``serial_fraction(kind, n, step_time_1, step_time_n) -> float``.
    ``kind`` is ``"strong"`` (a fixed global batch: each of the ``n`` ranks takes ``1/n`` of
    it) or ``"weak"`` (a fixed per-rank batch: ``n`` ranks do ``n`` times the work of one);
    ``step_time_1`` and ``step_time_n`` are the seconds per step on 1 rank and on ``n``.
    Return the serial fraction ``s`` of the law that models that kind: Amdahl's,
    ``S = 1 / (s + (1 - s) / n)``, for strong scaling; Gustafson's, ``S = n - s (n - 1)``, for
    weak scaling, where ``S`` is the speedup (the scaled speedup for weak scaling). Do not clip
    it: outside 0 to 1 it says that the law cannot describe the run.

    The checker compares with both laws turned around on five runs, one of each kind that the
    laws describe, an ideal one, one slower than a single rank and one faster than ideal. It
    needs no process group, only one rank to run in.

    Args:
        serial_fraction: your function.
        timeout: seconds the rank may take before it is stopped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``serial_fraction`` is not a function.
    """
    return _check_one(EXERCISES["serial_fraction"], (serial_fraction,), timeout)


def check_find_drifted(find_drifted: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check a detector of replicas that drifted from rank 0's, as in notebook 11's section 4.

    The exercise: write ``find_drifted(model, atol=1e-6) -> list[int]``. It is called on every
    rank with that rank's replica and returns, on every rank, the sorted list of the ranks whose
    parameters differ from rank 0's by more than ``atol`` in some element (rank 0 never is in
    it), without changing the model.

    The checker runs it on 3 ranks, each with notebook 11's small model changed on some
    ranks: none, one weight on rank 2, rank 1's last bits (within the tolerance), two weights
    swapped on rank 1 (a checksum cannot see it) and a bias on rank 0.

    Args:
        find_drifted: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``find_drifted`` is not a function.
    """
    return _check_one(EXERCISES["find_drifted"], (find_drifted,), timeout)
