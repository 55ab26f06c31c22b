"""A pipeline inside a layout: dp x tp x pp on 8 gloo ranks (and dp x pp on 4) equals one process.

One launch per layout (cached for the module) builds ``build_groups(layout)``. The model is two
seeded :class:`~mgtutor.parallel.tensor.Block` s; stage ``p`` holds block ``p``, split over its
tensor-parallel group (:class:`~mgtutor.parallel.tensor.ParallelBlock`). Each data-parallel
replica takes its half of a seeded global batch and runs GPipe with 2 micro-batches through
:class:`~mgtutor.parallel.pipeline.HandStage` and :func:`~mgtutor.parallel.pipeline.run_order`
over its pipeline group's global ranks (``ranks=groups.pp_ranks``); the gradients are averaged
over the dp group by hand. In float64 the loss and every gradient of each stage's block must
equal one process on the whole batch. The same launch averages over tp instead of dp, which must
miss, and asks for a stage on the default ranks (``stage ± 1``), which must be refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mgtutor
from mgtutor.parallel import tensor as tp
from mgtutor.parallel.layout import Layout, build_groups
from mgtutor.parallel.pipeline import HandStage, gpipe_order, run_order

DIM, HEADS, HIDDEN, BATCH, SEQ = 8, 4, 16, 4, 4  # BATCH: the global batch, split over dp
N_MICRO, TOLERANCE = 2, 1e-10
LAYOUTS = {"dp2 tp2 pp2": Layout(dp=2, tp=2, pp=2), "dp2 pp2": Layout(dp=2, pp=2)}


def _seeded() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The whole model (one block per stage) and the global batch, alike on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(tp.Block(DIM, HEADS, HIDDEN), tp.Block(DIM, HEADS, HIDDEN)).double()
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)
    return model, x, torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)


def _reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[nn.Module, float]:
    """One process, the whole global batch: the loss and, in the copy, every gradient."""
    whole = copy.deepcopy(model)
    loss = (whole(x) - y).pow(2).mean()
    loss.backward()
    return whole, loss.item()


def _one_step(model, x, y, groups, average_over: str) -> dict[str, Any]:
    """One GPipe step of this rank's stage and tensor shard; its loss, grads and messages."""
    layout = groups.layout
    block = tp.ParallelBlock(model[groups.pp_rank], group=groups.tp_group)
    mine, targets = (t.chunk(layout.dp, 0)[groups.dp_rank] for t in (x, y))
    tokens = mine.numel()  # the replica's loss is the mean over its whole half

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum() / tokens

    shape = (len(mine) // N_MICRO, SEQ, DIM)
    stage = HandStage(
        block, groups.pp_rank, layout.pp, shape, torch.float64, loss_fn, ranks=groups.pp_ranks
    )
    run_order(stage, gpipe_order(N_MICRO), mine.chunk(N_MICRO), targets.chunk(N_MICRO))
    average = getattr(groups, f"{average_over}_group")
    for p in block.parameters():
        dist.all_reduce(p.grad, group=average)
        p.grad /= layout.dp
    loss = None
    if stage.is_last:
        value = torch.stack(stage.losses).sum()
        dist.all_reduce(value, group=groups.dp_group)
        loss = value.item() / layout.dp
    return {"loss": loss, "block": block, "sent": stage.sent}


def _worker(layout: Layout) -> dict[str, Any]:
    mgtutor.setup(backend="gloo")
    groups = build_groups(layout)
    model, x, y = _seeded()
    whole, loss = _reference(model, x, y)
    try:  # the stage on the default ranks, stage s on rank s: wrong inside a layout
        HandStage(nn.Identity(), groups.pp_rank, layout.pp, (1,), loss_fn=torch.sub)
        refused = ""
    except ValueError as error:
        refused = str(error)
    runs = {}
    for average_over in ("dp", "tp"):
        step = _one_step(model, x, y, groups, average_over)
        runs[average_over] = {
            "loss": None if step["loss"] is None else abs(step["loss"] - loss),
            "grads": tp.gradient_errors(whole[groups.pp_rank], step["block"]),
            "sent": step["sent"],
        }
    return {"pp_rank": groups.pp_rank, "pp_ranks": groups.pp_ranks, "refused": refused, **runs}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def measured(request) -> tuple[Layout, list[dict[str, Any]]]:
    layout = LAYOUTS[request.param]
    run = mgtutor.launch(_worker, layout, world_size=layout.world_size, backend="gloo", timeout=60)
    return layout, run.results


def test_each_stage_talks_to_its_pipeline_groups_ranks(measured) -> None:
    layout, results = measured
    for rank, result in enumerate(results):
        assert result["pp_ranks"] in layout.group_ranks("pp")
        first, last = result["pp_ranks"]
        kind, peer = ("activation", last) if result["pp_rank"] == 0 else ("gradient", first)
        nbytes = BATCH // layout.dp // N_MICRO * SEQ * DIM * 8
        assert result["dp"]["sent"] == [(kind, peer, nbytes)] * N_MICRO, f"rank {rank}"


def test_pipeline_in_a_layout_equals_one_process_on_the_whole_batch(measured) -> None:
    _, results = measured
    for rank, result in enumerate(results):
        run = result["dp"]
        if result["pp_rank"] == 1:  # the last stage computes the loss
            assert run["loss"] < TOLERANCE, f"rank {rank}: loss off by {run['loss']}"
        wrong = {name: e for name, e in run["grads"].items() if not e < TOLERANCE}
        assert run["grads"] and not wrong, f"rank {rank}: gradients off: {wrong}"


def test_averaging_over_tp_instead_of_dp_misses(measured) -> None:
    layout, results = measured
    worst = max(max(result["tp"]["grads"].values()) for result in results)
    # With tp = 1 the tp group is the rank alone: the sum over it is this replica's gradient.
    assert worst > 1e-3, f"{layout}: averaged over tp, gradients within {worst} of one process"


def test_a_stage_on_the_default_ranks_is_refused_where_its_rank_differs(measured) -> None:
    layout, results = measured
    for rank, result in enumerate(results):
        if rank == result["pp_rank"]:  # stage s on rank s: the default ranks fit
            assert result["refused"] == ""
        else:
            assert result["refused"].startswith(f"rank {rank} runs stage {result['pp_rank']}")
            assert "ranks=groups.pp_ranks" in result["refused"]
