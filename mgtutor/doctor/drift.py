"""Replicas that drift apart: checksums of every parameter and buffer, compared across ranks."""

from __future__ import annotations

from typing import Any

__all__ = ["find_drift", "replica_checksums"]


def replica_checksums(module: Any, group: Any = None) -> dict[str, list[float]]:
    """Checksum every parameter and buffer on every rank, so ranks can be compared.

    A collective: every rank of the group must call it. DDP keeps replicas equal only if they
    start equal and receive the same updates; a buffer or parameter changed on one rank alone
    (a BatchNorm statistic with ``broadcast_buffers=False``, an in-place edit under
    ``if rank == 0``) makes them drift without any error.

    ``module`` may be a DDP wrapper or the bare module; ``group`` defaults to the world.

    Returns:
        name -> one checksum per rank (a position-weighted sum in float64), the same on every
        rank.
    """
    import torch
    import torch.distributed as dist

    named = list(module.named_parameters()) + list(module.named_buffers())
    rows = []
    for _, tensor in named:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64) / max(flat.numel(), 1)
        rows.append(torch.stack([flat.sum(), (flat * weights).sum()]))
    local = torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local, device=device) for _ in range(world)]
    dist.all_gather(gathered, local.to(device), group=group)
    table = torch.stack(gathered).cpu()  # [rank, tensor, 2]
    return {
        name: [float(table[r, i, 0] + table[r, i, 1]) for r in range(world)]
        for i, (name, _) in enumerate(named)
    }


def find_drift(module: Any, group: Any = None, rtol: float = 1e-9) -> list[str]:
    """Names of the parameters and buffers that differ between ranks (a collective).

    Args:
        module: the model.
        group: the process group (default: the whole world).
        rtol: relative difference of checksums tolerated (summation order, nothing else).

    Returns:
        The names whose checksum differs between ranks; empty when the replicas agree.
    """
    drifted = []
    for name, sums in replica_checksums(module, group).items():
        scale = max(abs(s) for s in sums) or 1.0
        if max(sums) - min(sums) > rtol * scale:
            drifted.append(name)
    return drifted
