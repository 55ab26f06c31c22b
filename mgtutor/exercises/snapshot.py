"""Notebook 09's exercise: a snapshot after which a restarted job continues bit for bit."""

from __future__ import annotations

import copy
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    make_finding,
    same_tensors,
)

__all__ = ["SNAPSHOT_EPOCHS", "TrainingJob", "EXERCISE", "check_snapshot", "run"]


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
    return check(EXERCISE, (save_snapshot, load_snapshot), timeout)


@dataclass
class TrainingJob:
    """Everything a training loop carries from step to step, as the snapshot exercise sees it.

    Attributes:
        model: the DDP-wrapped model (``model.module`` is the plain one).
        optimizer: its Adam optimizer.
        scheduler: a cosine learning-rate schedule, stepped after every optimizer step.
        sampler: the ``DistributedSampler`` of the training data (the loop calls its
            ``set_epoch(job.epoch)`` at the start of each epoch).
        epoch: the next epoch to train (after epoch 0 is done, 1).
    """

    model: DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: DistributedSampler
    epoch: int = 0


SNAPSHOT_EPOCHS, _SNAPSHOT_SAMPLES, _SNAPSHOT_BATCH = 2, 16, 4


def _new_job() -> tuple[TrainingJob, DataLoader]:
    """The job as a (re)started script builds it: seeded per rank, from scratch."""
    torch.manual_seed(1 + dist.get_rank())  # each rank draws its own augmentation noise
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_SNAPSHOT_SAMPLES, 4, dtype=torch.float64, generator=generator)
    data = TensorDataset(x, x.sum(1, keepdim=True).tanh())
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=_SNAPSHOT_BATCH, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=SNAPSHOT_EPOCHS * len(loader)
    )
    return TrainingJob(model, optimizer, scheduler, sampler), loader


def _train_epoch(job: TrainingJob, loader: DataLoader) -> list[float]:
    job.sampler.set_epoch(job.epoch)
    losses = []
    for x, y in loader:  # iterating a DataLoader also draws from torch's generator
        x = x + 0.1 * torch.randn_like(x)  # augmentation noise
        loss = F.mse_loss(job.model(x), y)
        job.optimizer.zero_grad()
        loss.backward()
        job.optimizer.step()
        job.scheduler.step()
        losses.append(loss.item())
    job.epoch += 1
    return losses


def _state(job: TrainingJob) -> dict[str, Any]:
    return {
        "epoch": job.epoch,
        "model": copy.deepcopy(job.model.module.state_dict()),
        "optimizer": copy.deepcopy(job.optimizer.state_dict()),
        "scheduler": copy.deepcopy(job.scheduler.state_dict()),
        "rng": torch.get_rng_state(),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


def _restart_process_group(tag: str) -> None:
    """Leave the process group and form a new one, as a restarted job's fresh processes do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=dist.PrefixStore(tag, store), rank=rank, world_size=world)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    save, load = cloudpickle.loads(payload)
    rank = dist.get_rank()
    path = os.path.join(folder or ".", f"candidate{index}", "snapshot.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)  # torch.save does not create folders
    case = "save after epoch 0, restart, load, train epoch 1"
    job, loader = _new_job()
    _train_epoch(job, loader)
    call_learner(index, "save_snapshot after epoch 0", save, path, job)
    saved = _state(job)
    uninterrupted = _train_epoch(job, loader)
    final = [p.detach().clone() for p in job.model.parameters()]
    saved_rngs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(saved_rngs, saved["rng"])

    del job, loader
    _restart_process_group(f"mgtutor-exercise-restart-{index}")
    job, loader = _new_job()
    fresh_rng = torch.get_rng_state()
    call_learner(index, "load_snapshot in the restarted job", load, path, job)
    loaded = _state(job)
    resumed: list[float] = []
    for _ in range(SNAPSHOT_EPOCHS):
        if job.epoch >= SNAPSHOT_EPOCHS:
            break
        resumed += _train_epoch(job, loader)
    after = [p.detach().clone() for p in job.model.parameters()]
    return [
        _diagnose_snapshot(
            case, rank, saved, loaded, saved_rngs, fresh_rng, uninterrupted, resumed, final, after
        )
    ]


def _diagnose_snapshot(
    case: str,
    rank: int,
    saved: dict[str, Any],
    loaded: dict[str, Any],
    saved_rngs: list[torch.Tensor],
    fresh_rng: torch.Tensor,
    uninterrupted: list[float],
    resumed: list[float],
    final: list[torch.Tensor],
    after: list[torch.Tensor],
) -> Finding:
    if loaded["epoch"] != saved["epoch"]:
        return make_finding(
            case,
            f"after loading, job.epoch is {loaded['epoch']}; the snapshot was taken with "
            f"job.epoch = {saved['epoch']}",
            "save job.epoch and set it back when loading: the loop resumes at job.epoch",
        )
    parts = {
        "model": "the model's weights: job.model.module.state_dict()",
        "optimizer": "the optimizer's state (Adam's moments and step counts): "
        "job.optimizer.state_dict()",
        "scheduler": "the learning-rate schedule: job.scheduler.state_dict()",
    }
    for key, what in parts.items():
        if not _equal(loaded[key], saved[key]):
            return make_finding(
                case,
                f"after loading, {key} differs from what it was when the snapshot was taken",
                f"save and restore {what}",
            )
    if not torch.equal(loaded["rng"], saved["rng"]):
        others = [r for r, state in enumerate(saved_rngs) if torch.equal(loaded["rng"], state)]
        if others:
            return make_finding(
                case,
                f"rank {rank} restored rank {others[0]}'s random generator state, not its own",
                "each rank draws its own random numbers: gather every rank's "
                "torch.get_rng_state() (dist.gather_object to rank 0, or one file per rank) "
                "and let each rank restore its own",
            )
        unrestored = torch.equal(loaded["rng"], fresh_rng)
        return make_finding(
            case,
            "torch's random generator "
            + ("was not restored: " if unrestored else "differs from the snapshot's: ")
            + "the restarted job draws other augmentation noise (and DataLoader seeds)",
            "save torch.get_rng_state() of every rank and restore it with torch.set_rng_state",
        )
    if resumed != uninterrupted or not same_tensors(after, final):
        step = next(
            (i for i, (a, b) in enumerate(zip(resumed, uninterrupted)) if a != b),
            min(len(resumed), len(uninterrupted)),
        )
        return make_finding(
            case,
            f"everything checked was restored, yet the resumed run's loss differs from the "
            f"uninterrupted run's at step {step + 1} of epoch 1",
            "look for other state the next step depends on",
            knock_on=True,
        )
    return make_finding(case)


EXERCISE = Exercise(
    key="snapshot",
    name="save_snapshot / load_snapshot",
    functions=("save_snapshot", "load_snapshot"),
    world_size=2,
    cases=(
        "train epoch 0, save_snapshot, a new process group and a fresh job, load_snapshot, "
        "train epoch 1: the same losses and weights as without the restart, bit for bit",
    ),
    run=run,
    reference=(solutions.save_snapshot, solutions.load_snapshot),
    hang_hint="a collective called on some ranks only (say, a gather inside if rank == 0) waits "
    "forever; call collectives on every rank",
    needs_folder=True,
)
