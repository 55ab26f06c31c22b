"""Low-communication data parallelism's one collective, and a slow link you can name.

LocalSGD (Stich, arXiv:1805.09767) and DiLoCo (Douillard et al., arXiv:2311.08105) let each
replica step on its own and meet every H steps: LocalSGD averages the parameters, DiLoCo
averages the *pseudo-gradient* (parameters at the last meeting minus now) and hands it to an
outer optimizer. Both need only one all-reduce of the model's size per meeting, which
:func:`average_` is. The outer step itself is written in notebook 19, where it is taught.

A slow link is simulated on the ranks' side: before each all-reduce the rank sleeps
``seconds_per_byte`` times the bytes it sends on a ring (:func:`ring_sent_bytes`). The delay
is known and named, not a shaped network; :func:`slow_allreduce_hook` puts the same delay in
front of DDP's bucket all-reduces, so both pay the same price per byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mgtutor.ring import bytes_sent_on_ring

__all__ = ["average_", "ring_sent_bytes", "slow_allreduce_hook"]


def ring_sent_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2 (N - 1) / N of the buffer
    (:func:`mgtutor.ring.bytes_sent_on_ring` for an all-reduce)."""
    return bytes_sent_on_ring("all_reduce", world_size, nbytes)


def _sleep_for(nbytes: int, world_size: int, seconds_per_byte: float) -> None:
    if seconds_per_byte > 0:
        time.sleep(seconds_per_byte * ring_sent_bytes(nbytes, world_size))


def average_(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    seconds_per_byte: float = 0.0,
) -> int:
    """Replace each tensor by its mean over the group's ranks, in one all-reduce.

    The tensors are flattened into one buffer (one collective per meeting, as DDP's buckets
    do), summed, divided by the group's size and copied back.

    Args:
        tensors: this rank's tensors (parameters, pseudo-gradients), all of one dtype.
        group: the process group; None is the default group.
        seconds_per_byte: the simulated link's delay, slept before the all-reduce.

    Returns:
        The bytes of the buffer that was all-reduced.
    """
    world = dist.get_world_size(group)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    _sleep_for(flat.nbytes, world, seconds_per_byte)
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return flat.nbytes


def slow_allreduce_hook(seconds_per_byte: float) -> Callable:
    """A DDP communication hook: torch's averaging all-reduce after the simulated link's delay.

    For ``ddp.register_comm_hook(None, hook)`` (the default group); each bucket first sleeps
    ``seconds_per_byte`` per byte this rank sends on a ring.
    """

    # Unannotated: DDP compares the annotations with its own types, and this module's are
    # strings (``from __future__ import annotations``).
    def hook(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        world = dist.get_world_size()
        _sleep_for(buffer.nbytes, world, seconds_per_byte)
        buffer.div_(world)
        future = dist.all_reduce(buffer, async_op=True).get_future()
        return future.then(lambda f: f.value()[0])

    return hook
