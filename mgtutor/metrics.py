"""Numbers averaged over ranks, exactly: what a rank calls to report one figure for the whole run.

Every rank sees only its shard, so a figure one rank prints describes part of the data. Both
functions are collectives: every rank of the process group must call them, in the same order,
or the ranks that did wait until the group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_mean", "reduce_sums"]


def _collective_device(device: torch.device | str | None) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU tensors (and CUDA ones, copied through host).
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_sums(
    *values: float | int | torch.Tensor, device: torch.device | str | None = None
) -> list[float]:
    """Add each value over all ranks with one ``all_reduce``; every rank gets the sums.

    Args:
        *values: numbers (or one-element tensors) this rank contributes, in the same order on
            every rank.
        device: where the reduction happens; by default the rank's GPU under NCCL, else CPU.

    Returns:
        The sums, as Python floats, in the order given (float64: whole counts exact to 2**53).

    Raises:
        ValueError: if no value is given or a tensor has more than one element.
        RuntimeError: if no process group is initialized (call ``mgtutor.setup()`` first).
    """
    if not values:
        raise ValueError("reduce_sums needs at least one value to add over the ranks")
    if not dist.is_initialized():
        raise RuntimeError(
            "reduce_sums is a collective: join the process group first (mgtutor.setup() or "
            "torch.distributed.init_process_group) in every rank"
        )
    numbers = []
    for position, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"value {position} has {value.numel()} elements; reduce_sums adds numbers. "
                    f"Sum the tensor first, or all_reduce it yourself."
                )
            value = value.detach().item()
        numbers.append(float(value))
    sums = torch.tensor(numbers, dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(sums)  # ReduceOp.SUM, the result on every rank
    return sums.tolist()


def reduce_mean(
    total: float | int | torch.Tensor,
    count: float | int = 1,
    *,
    device: torch.device | str | None = None,
) -> float:
    """The mean over all ranks' samples: (sum of ``total`` over ranks) / (sum of ``count``).

    Given each rank's *sum* and how many samples it summed, the result is the exact mean over
    every sample, whatever each rank's share. With the default ``count=1``,
    ``reduce_mean(local_mean)`` is the mean of the ranks' means: exact only for equal shares.

    Args:
        total: this rank's sum (or, with ``count=1``, its own figure).
        count: how many samples ``total`` sums.
        device: where the reduction happens; see :func:`reduce_sums`.

    Returns:
        The same float on every rank.

    Raises:
        ValueError: if the counts add up to zero.
    """
    summed_total, summed_count = reduce_sums(total, count, device=device)
    if summed_count == 0:
        raise ValueError("reduce_mean: the counts add up to 0 over all ranks; nothing to average")
    return summed_total / summed_count
