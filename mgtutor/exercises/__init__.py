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
:func:`check_bytes_per_rank` (12).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mgtutor.exercises import checking as _checking
from mgtutor.exercises.cases import (
    ACCUMULATION_CASES,
    ACCURACY_CASES,
    BATCH_STATS_CASES,
    BUCKET_CASES,
    BYTES_CASES,
    CHECKED_CASES,
    DRIFT_CASES,
    RING_CASES,
    SCALING_CASES,
    SHARD_CASES,
    TrainingJob,
)
from mgtutor.exercises.checking import CheckResult, _check_one, _Exercise

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
    "check_ring_average",
    "check_serial_fraction",
    "check_shard_indices",
    "check_snapshot",
]

_EXERCISES = {
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
    )
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


def check_shard_indices(shard_indices: Callable[..., Any], *, timeout: float = 30.0) -> CheckResult:
    """Check how a stream's samples are split between ranks and their DataLoader workers.

    The exercise: write ``shard_indices(n_samples, rank, world_size, worker_id, num_workers)
    -> list[int]``, the indices of the samples that DataLoader worker ``worker_id`` (of
    ``num_workers``) of rank ``rank`` (of ``world_size``) reads, for an ``IterableDataset``
    over samples ``0 .. n_samples - 1``: it runs once in every worker of every rank (with
    ``num_workers=0`` the loop itself reads: worker 0 of 1). Over all ranks and workers, every
    sample must be read exactly once, nothing dropped, and the ranks' counts may differ by one
    at most (under DDP each rank runs a step per batch).

    The checker runs it on 2 ranks: each rank calls it for each of its workers, on sample
    counts that divide and that do not, fewer samples than readers and no workers; then through
    a real ``DataLoader`` with 2 forked workers on each rank. The ranks exchange what each
    worker read.

    Args:
        shard_indices: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``shard_indices`` is not a function.
    """
    return _check_one(_EXERCISES["shard_indices"], (shard_indices,), timeout)


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
    return _check_one(_EXERCISES["serial_fraction"], (serial_fraction,), timeout)


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
    return _check_one(_EXERCISES["find_drifted"], (find_drifted,), timeout)


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
        exercise: the exercise, or its key in ``_EXERCISES`` ("ring_average", "exact_accuracy",
            "accumulate", "snapshot", "global_batch_stats", "checked_all_reduce",
            "bytes_per_rank", "assign_buckets", "shard_indices", "serial_fraction",
            "find_drifted").
        candidates: tuples of the functions the exercise takes.
        timeout: seconds per launch, from when every rank started.
        label: added to each result's name ("reference solution").

    Returns:
        One :class:`CheckResult` per candidate, in order.
    """
    if isinstance(exercise, str):
        exercise = _EXERCISES[exercise]
    return _checking._check(exercise, candidates, timeout, label)


# --- notebook 15: pipeline parallelism ------------------------------------------------------
from mgtutor.exercises.cases import GPIPE_CASES  # noqa: E402

__all__ += ["check_gpipe_step"]
_EXERCISES["gpipe_step"] = _Exercise(
    "gpipe_step",
    "gpipe_step",
    ("gpipe_step",),
    3,
    tuple(case for case, *_ in GPIPE_CASES),
    "a recv that no send matches waits forever: stage r receives activations from rank r - 1 "
    "and gradients from rank r + 1, as many of each as there are micro-batches; the first "
    "stage receives no activation and the last no gradient",
    {
        "TypeError": "a send of None (got <class 'NoneType'>) is the gradient of a received "
        "activation that did not require grad: call x.requires_grad_(True) after the recv, "
        "or backward leaves x.grad as None and there is nothing to send back",
    },
)


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
    return _check_one(_EXERCISES["gpipe_step"], (gpipe_step,), timeout)
