"""mgtutor.parallel.layout: the rank grid by formula, and dp x tp on 4 ranks equal to one process.

The grid's numbering, its groups and its checks need no process. One launch of 4 gloo ranks
(``measured``, cached for the module) builds ``Layout(dp=2, tp=2).groups()``; each tensor-parallel
pair splits the same seeded :class:`~mgtutor.parallel.tensor.Block` over its tp group, each
data-parallel replica takes its half of a seeded global batch, and the gradients are averaged
over the dp group by hand. In float64 the loss and every gradient must equal one process on the
whole batch, with and without sequence parallelism. The same launch runs the two ways of mixing
up the groups (averaging over tp instead of dp; the pieces on the default group instead of tp),
which must miss.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mgtutor
from mgtutor.parallel import tensor as tp
from mgtutor.parallel.layout import Layout

DIM, HEADS, HIDDEN, BATCH, SEQ = 8, 4, 16, 4, 4  # BATCH: the global batch, split over dp
TOLERANCE = 1e-10
#: (the group the gradients are averaged over, the group the pieces are split over)
VARIANTS = {
    "right": ("dp", "tp"),
    "averaged over tp": ("tp", "tp"),
    "pieces on the default group": ("dp", None),
}


def test_layout_counts_its_ranks_and_numbers_them_tp_first() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8 and Layout().world_size == 1
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinates(6) == {"dp": 1, "tp": 0, "pp": 1}
    for rank in range(layout.world_size):
        assert layout.rank_of(**layout.coordinates(rank)) == rank
    assert Layout(dp=3, tp=1).group_ranks("dp") == [[0, 1, 2]]
    assert Layout(dp=3, tp=1).group_ranks("tp") == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"dp": 0}, "dp"), ({"tp": -2}, "tp"), ({"pp": 1.5}, "pp"), ({"tp": True}, "tp")],
)
def test_layout_refuses_an_axis_that_is_not_a_positive_whole_number(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"Layout: {field}=.*pass {field}=1"):
        Layout(**kwargs)


def test_layout_refuses_coordinates_and_axes_outside_it() -> None:
    with pytest.raises(ValueError, match="rank 4 is outside"):
        Layout(dp=2, tp=2).coordinates(4)
    with pytest.raises(ValueError, match="tp coordinate 2"):
        Layout(dp=2, tp=2).rank_of(dp=0, tp=2, pp=0)
    with pytest.raises(ValueError, match="axis 'cp'"):
        Layout().group_ranks("cp")  # type: ignore[arg-type]


def test_groups_asks_for_a_process_group_first() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"mgtutor.setup\(\)"):
        Layout().groups()


def _reference(block: tp.Block, x: torch.Tensor) -> tuple[tp.Block, float]:
    """One process, the whole global batch: the loss and, in the copy, every gradient."""
    whole = copy.deepcopy(block)
    loss = whole(x).pow(2).mean()
    loss.backward()
    return whole, loss.item()


def _one_step(block, x, groups, sp: bool, average_over: str, pieces: str | None) -> dict:
    """One forward and backward of this rank's part; the errors against one process."""
    group = getattr(groups, f"{pieces}_group") if pieces else None
    parallel = tp.ParallelBlock(block, sequence_parallel=sp, group=group)
    mine = x.chunk(groups.layout.dp, 0)[groups.dp_rank]  # this replica's half of the batch
    tokens = mine.numel()  # the replica's loss is the mean over its whole half
    if sp:
        mine = mine.chunk(groups.layout.tp, 1)[groups.tp_rank]
    # Under sequence parallelism each tp rank holds part of the replica's sum; else all of it.
    loss = parallel(mine).pow(2).sum() / tokens
    loss.backward()
    if sp:
        tp.all_reduce_replicated_grads(parallel, group)
    value = loss.detach().clone()
    if sp:
        dist.all_reduce(value, group=groups.tp_group)
    average = getattr(groups, f"{average_over}_group")
    for p in parallel.parameters():
        dist.all_reduce(p.grad, group=average)
        p.grad /= groups.layout.dp
    dist.all_reduce(value, group=groups.dp_group)
    return {"loss": value.item() / groups.layout.dp, "grads": parallel}


def _worker() -> dict[str, Any]:
    mgtutor.setup(backend="gloo")
    try:
        Layout(dp=3).groups()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    groups = Layout(dp=2, tp=2).groups()
    torch.manual_seed(0)
    block = tp.Block(DIM, HEADS, HIDDEN).double()
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)
    whole, loss = _reference(block, x)
    runs = {}
    for sp in (False, True):
        for name, (average_over, pieces) in VARIANTS.items():
            step = _one_step(block, x, groups, sp, average_over, pieces)
            runs[(sp, name)] = {
                "loss": abs(step["loss"] - loss),
                "grads": tp.gradient_errors(whole, step["grads"]),
            }
    return {
        "refused": refused,
        "where": (groups.dp_rank, groups.tp_rank, groups.pp_rank),
        "ranks": (groups.dp_ranks, groups.tp_ranks, groups.pp_ranks),
        "sizes": tuple(dist.get_world_size(g) for g in (groups.dp_group, groups.tp_group)),
        "runs": runs,
    }


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    return mgtutor.launch(_worker, world_size=4, backend="gloo", timeout=120).results


def test_groups_gives_each_rank_its_coordinates_and_its_axes_ranks(measured) -> None:
    layout = Layout(dp=2, tp=2)
    for rank, result in enumerate(measured):
        where = layout.coordinates(rank)
        assert result["where"] == (where["dp"], where["tp"], where["pp"])
        dp_ranks, tp_ranks, pp_ranks = result["ranks"]
        assert rank in dp_ranks and dp_ranks in layout.group_ranks("dp")
        assert rank in tp_ranks and tp_ranks in layout.group_ranks("tp")
        assert pp_ranks == [rank]
        assert result["sizes"] == (2, 2)


def test_groups_refuses_a_layout_of_another_size_on_every_rank(measured) -> None:
    for rank, result in enumerate(measured):
        assert result["refused"].startswith(f"rank {rank}: Layout(dp=3, tp=1, pp=1) needs")
        assert "the process group has 4" in result["refused"]


@pytest.mark.parametrize("sp", [False, True], ids=["tensor parallel", "sequence parallel"])
def test_dp_by_tp_equals_one_process_on_the_whole_batch(measured, sp) -> None:
    for rank, result in enumerate(measured):
        run = result["runs"][(sp, "right")]
        assert run["loss"] < TOLERANCE, f"rank {rank}: loss off by {run['loss']}"
        wrong = {name: e for name, e in run["grads"].items() if not e < TOLERANCE}
        assert not wrong, f"rank {rank}: gradients off: {wrong}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "right"])
@pytest.mark.parametrize("sp", [False, True], ids=["tensor parallel", "sequence parallel"])
def test_the_wrong_group_misses_one_process(measured, sp, variant) -> None:
    # The check above can fail: the same step with its groups mixed up is far off somewhere.
    worst = max(
        max(result["runs"][(sp, variant)]["grads"].values(), default=0.0) for result in measured
    )
    assert worst > 1e-3, f"{variant}: gradients within {worst} of one process"
