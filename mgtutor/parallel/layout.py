"""A layout's process groups: one per axis, built in a launched rank.

:func:`build_groups` takes a :class:`~mgtutor.grid.Layout` (the dp x tp x pp grid, pure arithmetic,
re-exported here) and, in every rank, builds one process group per axis and tells the rank
where it stands. The parallel pieces then take their group from it
(``ParallelBlock(block, group=layout_groups.tp_group)``), so tensor, data and pipeline
parallelism run on one set of ranks, each collective on its own axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mgtutor.grid import AXES, Axis, Layout

__all__ = ["AXES", "Axis", "Layout", "LayoutGroups", "build_groups"]


@dataclass(frozen=True)
class LayoutGroups:
    """One rank's place in a :class:`Layout`: its coordinates, and each axis's group and ranks.

    ``dp_ranks`` lists the global ranks of this rank's data-parallel group (``dp_group``), in
    the order of their ``dp_rank``; the same for tp and pp.
    """

    layout: Layout
    rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_ranks: list[int]
    tp_ranks: list[int]
    pp_ranks: list[int]
    dp_group: Any = field(repr=False)
    tp_group: Any = field(repr=False)
    pp_group: Any = field(repr=False)


def build_groups(layout: Layout, backend: str | None = None) -> LayoutGroups:
    """Build every axis's process groups of ``layout``; return this rank's place and groups.

    Call it in every rank, after :func:`mgtutor.setup`, at the same point: each group is made
    with ``dist.new_group``, which every rank of the default group must call for every group in
    the same order, so every rank builds all of them and keeps its own.

    Args:
        layout: the grid of ranks.
        backend: the groups' backend; None takes the default group's.

    Returns:
        This rank's coordinates, and each axis's group and global ranks.

    Raises:
        RuntimeError: no process group yet, or not ``dp * tp * pp`` ranks in it.

    Example:
        >>> here = build_groups(Layout(dp=2, tp=2))  # in each of 4 launched ranks
        >>> here.tp_ranks, here.dp_ranks  # on rank 1: [0, 1], [1, 3]
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"build_groups({layout}) needs a process group: call mgtutor.setup() in the rank first"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(
            f"rank {rank}: {layout} needs dp*tp*pp = {layout.world_size} ranks, the process "
            f"group has {world}: launch {layout.world_size} ranks or choose dp, tp, pp whose "
            f"product is {world}"
        )
    found: dict[str, Any] = {}
    for axis in AXES:
        for members in layout.group_ranks(axis):
            group = dist.new_group(members, backend=backend)
            if rank in members:
                found[f"{axis}_group"], found[f"{axis}_ranks"] = group, members
    where = layout.coordinates(rank)
    return LayoutGroups(
        layout=layout,
        rank=rank,
        dp_rank=where["dp"],
        tp_rank=where["tp"],
        pp_rank=where["pp"],
        **found,
    )
