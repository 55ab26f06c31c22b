"""A layout of the ranks: how many replicas (dp), tensor shards (tp) and stages (pp).

:class:`Layout` names a dp x tp x pp grid of ranks; :meth:`Layout.groups`, called in a launched
rank, builds one process group per axis and tells the rank where it stands. The parallel pieces
then take their group from it (``ParallelBlock(block, group=groups.tp_group)``), so tensor and
data parallelism run on one set of ranks, each collective on its own axis.

The ranks are numbered as Megatron-LM numbers them: tp varies fastest, then dp, then pp,
``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``. The ranks of one tensor-parallel group
are neighbours, the axis that talks most on the fastest links of one machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist

__all__ = ["AXES", "Axis", "Layout", "LayoutGroups"]

Axis = Literal["dp", "tp", "pp"]
#: The axes in the order Layout names them (ranks vary fastest along tp, then dp, then pp).
AXES: tuple[Axis, ...] = ("dp", "tp", "pp")


@dataclass(frozen=True)
class Layout:
    """A grid of ``dp * tp * pp`` ranks, checked when it is made.

    Args:
        dp: data-parallel replicas, each on its share of the batch.
        tp: tensor-parallel ranks that split each layer's weights.
        pp: pipeline stages, each holding some of the layers.

    Example:
        >>> layout = Layout(dp=2, tp=2)
        >>> layout.world_size, layout.coordinates(3)
        (4, {'dp': 1, 'tp': 1, 'pp': 0})
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Layout: {axis}={value!r} must be a whole number of ranks, 1 or more; "
                    f"pass {axis}=1 for an axis that is not split"
                )

    @property
    def world_size(self) -> int:
        """How many ranks the layout needs: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        """The global rank at these coordinates (tp fastest-varying, then dp, then pp)."""
        for axis, value in zip(AXES, (dp, tp, pp)):
            if not 0 <= value < getattr(self, axis):
                raise ValueError(
                    f"{axis} coordinate {value} is outside 0..{getattr(self, axis) - 1}"
                )
        return pp * self.dp * self.tp + dp * self.tp + tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` stands on each axis: ``{"dp": ..., "tp": ..., "pp": ...}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of {self}")
        return {
            "dp": rank // self.tp % self.dp,
            "tp": rank % self.tp,
            "pp": rank // (self.tp * self.dp),
        }

    def group_ranks(self, axis: Axis) -> list[list[int]]:
        """Every group of one axis: the ranks that differ only in that coordinate.

        For ``Layout(dp=2, tp=2, pp=2)``: tp ``[[0, 1], [2, 3], [4, 5], [6, 7]]``, dp
        ``[[0, 2], [1, 3], [4, 6], [5, 7]]``, pp ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
        """
        if axis not in AXES:
            raise ValueError(f"axis {axis!r} is not one of {', '.join(map(repr, AXES))}")
        groups: list[list[int]] = []
        for rank in range(self.world_size):
            if self.coordinates(rank)[axis] == 0:  # the first rank of its group
                where = self.coordinates(rank)
                members = []
                for i in range(getattr(self, axis)):
                    where[axis] = i
                    members.append(self.rank_of(**where))
                groups.append(members)
        return groups

    def groups(self, backend: str | None = None) -> LayoutGroups:
        """Build every axis's process groups; return this rank's coordinates and groups.

        Call it in every rank, after :func:`mgtutor.setup`, at the same point: each group is
        made with ``dist.new_group``, which every rank of the default group must call for every
        group in the same order, so every rank builds all of them and keeps its own.

        Args:
            backend: the groups' backend; None takes the default group's.

        Raises:
            RuntimeError: no process group yet, or not ``dp * tp * pp`` ranks in it.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                f"{self}.groups() needs a process group: call mgtutor.setup() in the rank first"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != self.world_size:
            raise RuntimeError(
                f"rank {rank}: {self} needs dp*tp*pp = {self.world_size} ranks, the process "
                f"group has {world}: launch {self.world_size} ranks or choose dp, tp, pp whose "
                f"product is {world}"
            )
        found: dict[str, Any] = {}
        for axis in AXES:
            for members in self.group_ranks(axis):
                group = dist.new_group(members, backend=backend)
                if rank in members:
                    found[f"{axis}_group"], found[f"{axis}_ranks"] = group, members
        where = self.coordinates(rank)
        return LayoutGroups(
            layout=self,
            rank=rank,
            dp_rank=where["dp"],
            tp_rank=where["tp"],
            pp_rank=where["pp"],
            **found,
        )


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
