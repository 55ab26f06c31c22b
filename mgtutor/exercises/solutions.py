"""Reference solutions of the notebooks' exercises, kept out of the notebooks on purpose.

:mod:`mgtutor.exercises` runs a learner's function through its checks; while the learner's cell
still holds the stub, it runs these instead, to show what passing looks like. Read them after
your own answer passes, or when you are stuck: each is the plain version a learner could write.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "accumulate",
    "assign_buckets",
    "bytes_per_rank",
    "checked_all_reduce",
    "copy_to_parallel",
    "exact_accuracy",
    "find_drifted",
    "global_batch_stats",
    "load_snapshot",
    "merge_partials",
    "reduce_from_parallel",
    "ring_average",
    "save_snapshot",
    "serial_fraction",
    "shard_indices",
]


def ring_average(tensor: torch.Tensor) -> None:
    """Average ``tensor`` over all ranks, in place, with a ring of point-to-point messages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    # tensor_split, unlike chunk, always gives `world` pieces (some empty when there are fewer
    # elements than ranks); views of the flattened tensor, so writing a piece writes the tensor.
    chunks = list(tensor.view(-1).tensor_split(world))
    for step in range(world - 1):  # reduce-scatter: chunk (rank + 1) ends up summed here
        out, into = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[into])
        request = dist.isend(chunks[out], dst=right)
        assert request is not None  # isend gives None only to a rank outside the group
        dist.recv(incoming, src=left)
        request.wait()
        chunks[into] += incoming
    chunks[(rank + 1) % world].div_(world)  # divide once, the chunk this rank completed
    for step in range(world - 1):  # all-gather: pass the finished chunks around the ring
        out, into = (rank - step + 1) % world, (rank - step) % world
        request = dist.isend(chunks[out], dst=right)
        assert request is not None
        dist.recv(chunks[into], src=left)
        request.wait()


def exact_accuracy(correct: torch.Tensor, sampler: Any) -> float:
    """The accuracy over every sample the sampler hands out, each counted once, on every rank."""
    # The padded order is the shuffled order plus repeats at its end; rank r's i-th index sits
    # at position r + i * num_replicas of it, so the positions past len(dataset) are repeats.
    positions = sampler.rank + sampler.num_replicas * torch.arange(len(correct))
    real = positions < len(sampler.dataset)
    counts = torch.tensor([float(correct[real].sum()), float(real.sum())], dtype=torch.float64)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def accumulate(
    model: DistributedDataParallel, optimizer: torch.optim.Optimizer, micro_batches: list, k: int
) -> None:
    """Train through ``micro_batches`` with one optimizer step (and one all-reduce) per k."""
    for start in range(0, len(micro_batches), k):
        window = micro_batches[start : start + k]  # the last one may hold fewer than k
        for i, (x, y) in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # forward too
                loss = F.mse_loss(model(x), y) / len(window)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def save_snapshot(path: str | os.PathLike[str], job: Any) -> None:
    """Rank 0 saves everything the next step depends on, with every rank's generator state."""
    from mgtutor.checkpoint import save_checkpoint

    states: list[torch.Tensor | None] | None = None
    if dist.get_rank() == 0:
        states = [None] * dist.get_world_size()
    dist.gather_object(torch.get_rng_state(), states, dst=0)
    if dist.get_rank() == 0:
        save_checkpoint(
            {
                "model": job.model.module.state_dict(),
                "optimizer": job.optimizer.state_dict(),
                "scheduler": job.scheduler.state_dict(),
                "epoch": job.epoch,
                "rng": states,
            },
            path,
        )
    dist.barrier()  # nobody goes on (or loads) before the file is complete


def load_snapshot(path: str | os.PathLike[str], job: Any) -> None:
    """Every rank restores the job from the snapshot, and its own generator state."""
    from mgtutor.checkpoint import load_checkpoint

    snapshot = load_checkpoint(path)
    if len(snapshot["rng"]) != dist.get_world_size():
        raise ValueError("this snapshot was taken with another number of ranks")
    job.model.module.load_state_dict(snapshot["model"])
    job.optimizer.load_state_dict(snapshot["optimizer"])
    job.scheduler.load_state_dict(snapshot["scheduler"])
    job.epoch = snapshot["epoch"]
    torch.set_rng_state(snapshot["rng"][dist.get_rank()])


def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of the global batch, from three sums per channel."""
    dims = [0, *range(2, x.dim())]  # every dimension but the channels'
    count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64)
    # float64 sums: E[x²] - mean² loses digits when the mean is large against the spread.
    sums = torch.cat([count, x.double().sum(dims), x.double().pow(2).sum(dims)])
    dist.all_reduce(sums)  # one collective for the count and both sums, as SyncBatchNorm does
    n, channels = sums[0], x.shape[1]
    mean = sums[1 : 1 + channels] / n
    var = sums[1 + channels :] / n - mean**2  # biased: divided by n, as BatchNorm normalizes
    return mean.to(x.dtype), var.to(x.dtype)


def checked_all_reduce(tensor: torch.Tensor) -> None:
    """``dist.all_reduce(tensor)``, after checking that every rank has its shape and dtype."""
    mine = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # objects: no need for equal sizes to gather
    if any(other != mine for other in everyone):  # every rank sees all, so all decide alike
        ranks = ", ".join(f"rank {r}: {shape} {dtype}" for r, (shape, dtype) in enumerate(everyone))
        raise ValueError(f"all_reduce needs one shape and dtype on every rank, got {ranks}")
    dist.all_reduce(tensor)


def shard_indices(
    n_samples: int, rank: int, world_size: int, worker_id: int, num_workers: int
) -> list[int]:
    """The samples one DataLoader worker of one rank reads; every sample read, every rank alike.

    Padded as DistributedSampler pads: the first samples again (the order tiled if need be) until
    every rank has ceil(n_samples / world_size). Each rank's share is split between its workers
    alike, so worker w yields the same number of batches on every rank, whatever the batch size.
    """
    per_rank = -(-n_samples // world_size)
    padded = [i % n_samples for i in range(per_rank * world_size)]
    return padded[rank::world_size][worker_id::num_workers]


def serial_fraction(kind: str, n: int, step_time_1: float, step_time_n: float) -> float:
    """The serial fraction of a run on n ranks, by Amdahl's law (strong) or Gustafson's (weak).

    Not clipped: outside 0 to 1 it says that the law cannot describe the run.
    """
    if kind == "strong":  # one problem split n ways: S = t1 / tn = 1 / (s + (1 - s) / n)
        speedup = step_time_1 / step_time_n
        return (n / speedup - 1) / (n - 1)
    if kind == "weak":  # n times the work in the n-rank step: S = n t1 / tn = n - s (n - 1)
        speedup = n * step_time_1 / step_time_n
        return (n - speedup) / (n - 1)
    raise ValueError(f"kind must be 'strong' or 'weak', got {kind!r}")


def find_drifted(model: torch.nn.Module, atol: float = 1e-6) -> list[int]:
    """The ranks whose parameters differ from rank 0's by more than ``atol``, on every rank."""
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])  # a copy
    reference = mine.clone()
    dist.broadcast(reference, src=0)  # into the copy: finding the drift must not repair it
    drifted = torch.zeros(dist.get_world_size())
    # allclose, not max() > atol: a NaN (a replica that diverged) counts as a difference.
    drifted[dist.get_rank()] = float(not torch.allclose(mine, reference, rtol=0.0, atol=atol))
    dist.all_reduce(drifted)  # every rank learns every rank's verdict
    return [rank for rank, flag in enumerate(drifted.tolist()) if flag]


def bytes_per_rank(n_params: int, world_size: int, strategy: str) -> list[int]:
    """Bytes of parameters, gradients and Adam state on each rank, all float32."""
    if strategy == "ddp":  # everything on every rank: 4 + 4 + 8 bytes per parameter
        return [16 * n_params] * world_size
    if strategy == "zero1":  # Adam's state split by element, the first ranks one more
        shares = [n_params // world_size + (r < n_params % world_size) for r in range(world_size)]
        return [8 * n_params + 8 * share for share in shares]
    if strategy == "fsdp":  # torch.chunk shards, padded to the first one's size
        padded = -(-n_params // world_size)
        held = [max(0, min(padded, n_params - r * padded)) for r in range(world_size)]
        return [8 * padded + 8 * rows for rows in held]
    raise ValueError(f"strategy must be 'ddp', 'zero1' or 'fsdp', got {strategy!r}")


def assign_buckets(
    param_sizes_bytes: list[int], cap_bytes: int, first_cap_bytes: int
) -> list[list[int]]:
    """DDP's buckets: parameters from the last to the first, each bucket closed at its cap."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for index in reversed(range(len(param_sizes_bytes))):  # the order gradients become ready
        bucket.append(index)  # added first: a bucket can end larger than its cap
        size += param_sizes_bytes[index]
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class _Copy(torch.autograd.Function):
    """Copy in forward, all-reduce in backward: Megatron-LM's f."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # autograd may pass the same gradient elsewhere
        dist.all_reduce(grad)
        return grad


class _Reduce(torch.autograd.Function):
    """All-reduce in forward, copy in backward: Megatron-LM's g."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def copy_to_parallel(x: torch.Tensor) -> torch.Tensor:
    """Enter a tensor-parallel region: x unchanged; its gradient summed over the ranks."""
    return _Copy.apply(x)


def reduce_from_parallel(x: torch.Tensor) -> torch.Tensor:
    """Leave a tensor-parallel region: the ranks' partial sums added; the gradient unchanged."""
    return _Reduce.apply(x)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two blocks of keys from each block's output and log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)  # log(exp(lse_a) + exp(lse_b)), without overflow
    # Where no key was seen, lse is -inf and -inf - (-inf) is NaN: weigh such rows by 0.
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


__all__ += ["plan_dispatch"]


def plan_dispatch(
    experts: torch.Tensor, keep: torch.Tensor, experts_per_rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Which assignments go to which rank: grouped by expert, counted per expert and per rank."""
    flat = experts.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)  # dropped assignments are not sent
    order = kept[torch.argsort(flat[kept], stable=True)]  # expert 0's rows first: rank blocks
    per_expert = torch.bincount(flat[kept], minlength=experts_per_rank * world)
    send = per_expert.reshape(world, experts_per_rank).sum(1).tolist()
    return order, per_expert, send


# --- notebook 15: pipeline parallelism ------------------------------------------------------
__all__ += ["gpipe_step"]


def gpipe_step(
    stage_module: torch.nn.Module,
    micro_batches: list,
    targets: list,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """One GPipe step of stage ``rank``: every micro-batch forward, then every one backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kept, sends = [], []
    for x, target in zip(micro_batches, targets):
        if rank > 0:  # the activation from the stage before, same shape as a micro-batch here
            x = torch.empty_like(x)
            dist.recv(x, src=rank - 1)
            x.requires_grad_(True)  # so that backward fills x.grad, sent back to rank - 1
        out = stage_module(x)
        if rank < world - 1:
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        else:
            out = loss_fn(out, target)  # the step's loss is the sum of these: never divided
        kept.append((x, out))
    for x, out in kept:
        if rank < world - 1:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        else:
            out.backward()
        if rank > 0:
            sends.append(dist.isend(x.grad, dst=rank - 1))
    for work in sends:
        assert work is not None  # isend gives None only to a rank outside the group
        work.wait()
