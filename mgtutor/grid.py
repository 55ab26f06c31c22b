"""A layout of the ranks: a dp x tp x pp grid, by arithmetic alone (no process, no torch).

:class:`Layout` names how many replicas (dp), tensor shards (tp) and pipeline stages (pp) a run
has, and numbers its ranks. Both sides take it: the planner (:func:`mgtutor.plan.planner.plan`,
``layout=``) predicts what the grid holds and sends, and the parallel pieces run on it
(:func:`mgtutor.parallel.layout.build_groups` builds one process group per axis in a rank).

The ranks are numbered as Megatron-LM numbers them: tp varies fastest, then dp, then pp,
``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``. The ranks of one tensor-parallel group
are neighbours, the axis that talks most on the fastest links of one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AXES", "Axis", "Layout"]

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
