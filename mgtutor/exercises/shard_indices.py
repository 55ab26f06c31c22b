"""Notebook 06's exercise: a stream's samples split between the ranks and their loader workers."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mgtutor.build import loader_context, loader_start_method
from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_shard_indices", "default_timeout", "run"]

BATCH_SIZE = 2  # the DataLoader's, in the cases read through one
CASES = (  # label, samples, workers per rank, through a real DataLoader
    ("10 samples, 2 workers per rank", 10, 2, False),
    ("11 samples through a real DataLoader, 2 workers per rank, batches of 2", 11, 2, True),
    ("7 samples, num_workers=0 (the loop reads: worker 0 of 1)", 7, 1, False),
    ("3 samples, 3 workers per rank: fewer samples than readers", 3, 3, False),
    ("13 samples through a real DataLoader, 2 workers per rank, batches of 2", 13, 2, True),
)
Reads = list[list[list[int]]]  # reads[rank][worker]: the samples that worker returned


def check_shard_indices(
    shard_indices: Callable[..., Any], *, timeout: float | None = None
) -> CheckResult:
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
    through a real ``DataLoader`` (batches of 2, 2 workers on each rank, started as notebook
    06's are: :func:`mgtutor.build.loader_start_method`), counting the batches each rank's
    loader yields. The ranks exchange what each worker read.

    Args:
        shard_indices: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported;
            by default 30, or 60 where the workers are not forked (each rank's forkserver
            imports torch first, which takes seconds on a busy laptop).

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``shard_indices`` is not a function.
    """
    return check(EXERCISE, (shard_indices,), timeout or default_timeout())


def default_timeout() -> float:
    """:func:`check_shard_indices`'s timeout here: 30 s, or 60 s where workers are not forked."""
    return 30.0 if loader_start_method() == "fork" else 60.0


class _Stream(IterableDataset):
    """An IterableDataset that asks the learner's function which samples this worker reads.

    It pickles the function by value (cloudpickle): a worker started with spawn (macOS) could not
    look up by name a function defined in a notebook cell.
    """

    def __init__(self, fn: Callable[..., Any], n: int, rank: int, world: int) -> None:
        self.fn, self.n, self.rank, self.world = fn, n, rank, world

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fn": cloudpickle.dumps(self.fn)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, fn=cloudpickle.loads(state["fn"]))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = get_worker_info()  # None when the loop itself reads (num_workers=0)
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for sample in self.fn(self.n, self.rank, self.world, worker, workers):
            yield worker, sample


def _through_loader(
    fn: Callable[..., Any], n: int, rank: int, world: int, workers: int
) -> tuple[list, int]:
    """What each worker read, and how many batches the DataLoader yielded on this rank."""
    # Workers started as notebook 06's are (mgtutor.build.loader_start_method): forked on Linux,
    # from this rank's own forkserver on Python 3.10.0-3.10.14 and 3.11.0-3.11.9, spawned on macOS.
    loader = DataLoader(
        _Stream(fn, n, rank, world),
        batch_size=BATCH_SIZE,
        num_workers=workers,
        multiprocessing_context=loader_context(__name__),
    )
    reads: list[list[int]] = [[] for _ in range(workers)]
    batches = 0
    for worker_ids, samples in loader:  # a batch comes from one worker: its samples, in order
        batches += 1
        for worker, sample in zip(worker_ids.tolist(), samples.tolist()):
            reads[worker].append(sample)
    return reads, batches


def _direct(
    fn: Callable[..., Any], n: int, rank: int, world: int, workers: int
) -> tuple[list, None]:
    return [fn(n, rank, world, worker, workers) for worker in range(workers)], None


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, n, workers, loader in CASES:
        reader = _through_loader if loader else _direct
        mine, batches = call_learner(index, case, reader, fn, n, rank, world, workers)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (_as_samples(mine), batches))
        reads, batch_counts = [r for r, _ in everyone], [b for _, b in everyone]
        findings.append(_diagnose_shards(case, reads, n, workers, batch_counts))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _as_samples(worker_reads: list) -> list[list[int]] | str:
    """The samples each worker read, as ints; or what was wrong with what came back."""
    out = []
    for worker, returned in enumerate(worker_reads):
        try:
            out.append([operator.index(sample) for sample in returned])
        except TypeError:
            return f"call for worker {worker} returned {type(returned).__name__} {returned!r:.60}"
    return out


def _diagnose_shards(
    case: str, everyone: list, n: int, workers: int, batches: list[int | None]
) -> Finding:
    """Every rank sees every rank's reads and batch count, so every rank reaches one finding."""
    world = len(everyone)
    for rank, reads in enumerate(everyone):
        if isinstance(reads, str):
            return make_finding(
                case,
                f"on rank {rank}, the {reads}",
                "return the indices this worker reads, a list of ints (a range works too)",
            )
    readers: dict[int, list[str]] = {}
    for rank, reads in enumerate(everyone):
        for worker, samples in enumerate(reads):
            for sample in samples:
                readers.setdefault(sample, []).append(f"rank {rank}'s worker {worker}")
    outside = sorted(s for s in readers if not 0 <= s < n)
    if outside:
        return make_finding(
            case,
            f"sample {outside[0]} was read, which does not exist (the samples are 0 to {n - 1})",
            "read only the indices 0 to n_samples - 1; a shard that starts near the end may be "
            "empty",
        )
    padding = (-n) % world  # DistributedSampler's: reads beyond it are duplicates
    twice = sorted(s for s, who in readers.items() if len(who) > 1)
    if sum(len(who) for who in readers.values()) > n + padding:
        return _duplicates(case, everyone, readers, twice, workers)
    missing = [s for s in range(n) if s not in readers]
    if missing:
        last = missing == list(range(n - len(missing), n))
        return make_finding(
            case,
            f"{len(missing)} of the {n} samples were read by nobody: {missing}"
            + (", the last ones" if last else ""),
            (
                "the samples left over when n_samples does not divide by world_size x "
                "num_workers belong to some reader too: stride through them "
                "(range(start, n_samples, step)) instead of cutting n_samples // readers each"
                if last
                else "together the readers must cover every index from 0 to n_samples - 1"
            ),
        )
    # DistributedSampler pads with the first samples again (indices += indices[:padding],
    # torch/utils/data/distributed.py): the reads beyond one per sample must be exactly those.
    extra = sorted(s for s, who in readers.items() for _ in who[1:])
    expected = sorted(i % n for i in range(n, n + padding))
    if extra and extra != expected:
        return make_finding(
            case,
            f"every sample was read, and {extra} again, where DistributedSampler's padding reads "
            f"{expected} again",
            "pad as DistributedSampler does, with the first samples again: the padded order is "
            "sample i % n_samples for i in range(ceil(n_samples / world_size) * world_size)",
        )
    if None not in batches and len(set(batches)) > 1:
        by_rank = ", ".join(f"rank {r} {b}" for r, b in enumerate(batches))
        return make_finding(
            case,
            f"every sample was read, but the DataLoader (batch_size={BATCH_SIZE}, "
            f"num_workers={workers}) gave different batch counts: {by_rank}; under DDP a rank "
            "with a batch more takes a step more and waits in an all-reduce that the others "
            "never call",
            "each worker makes its own batches, so give every rank the same number of samples "
            "(pad with the first samples again, as DistributedSampler does: "
            "ceil(n_samples / world_size) per rank) and split each rank's share between its "
            "workers the same way on every rank",
        )
    counts = [sum(len(samples) for samples in reads) for reads in everyone]
    if len(set(counts)) > 1:
        worker_major = [
            [list(range(r * workers + w, n, world * workers)) for w in range(workers)]
            for r in range(world)
        ]
        by_rank = ", ".join(f"rank {r} read {c}" for r, c in enumerate(counts))
        return make_finding(
            case,
            f"every sample was read, but {by_rank}: under DDP a rank with more samples can "
            f"run more steps and wait in an all-reduce that the others never call",
            (
                "that numbers the readers rank * num_workers + worker_id, so the samples left "
                "over all go to the first ranks' workers: deal the samples to the ranks first "
                "(every world_size-th from rank on, padded to ceil(n_samples / world_size) with "
                "the first samples again), then split the rank's share between its workers"
                if everyone == worker_major
                else "give every rank ceil(n_samples / world_size) samples, padding with the "
                "first samples again as DistributedSampler does, then split each rank's share "
                "between its workers"
            ),
        )
    return make_finding(case)


def _duplicates(
    case: str, everyone: list, readers: dict[int, list[str]], twice: list[int], workers: int
) -> Finding:
    sample = twice[0]
    who = readers[sample]
    detail = f"sample {sample} was read by {', '.join(who[:-1])} and {who[-1]}" + (
        f" ({len(twice)} samples read more than once)" if len(twice) > 1 else ""
    )
    every_worker_alike = workers > 1 and all(
        all(samples == reads[0] for samples in reads) for reads in everyone
    )
    every_rank_alike = all(reads == everyone[0] for reads in everyone)
    if every_worker_alike and every_rank_alike:
        return make_finding(
            case,
            f"{detail}: every worker of every rank read the same samples",
            "nothing is split: DataLoader runs a copy of an IterableDataset in each worker of "
            "each rank, and each copy must pick its own part, from rank, world_size, worker_id "
            "and num_workers",
        )
    if every_worker_alike:
        return make_finding(
            case,
            f"{detail}: the workers of a rank all read that rank's whole shard",
            "that shards by rank only: DataLoader runs a copy of an IterableDataset in every "
            "worker, so each worker must also take its own part of the rank's shard (every "
            "num_workers-th sample of it, from worker_id on)",
        )
    if every_rank_alike:
        return make_finding(
            case,
            f"{detail}: worker w of every rank read the same samples",
            "that shards by worker only: the ranks run the same code, so a split between the "
            "workers alone repeats on every rank; split by rank first, then by worker",
        )
    return make_finding(
        case,
        detail,
        "each sample must belong to exactly one (rank, worker) pair: there are world_size x "
        "num_workers readers in all",
    )


EXERCISE = Exercise(
    key="shard_indices",
    name="shard_indices",
    functions=("shard_indices",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.shard_indices,),
    hang_hint="the function does not return: it needs no collective and no loop that waits, only "
    "arithmetic on its five arguments",
)
