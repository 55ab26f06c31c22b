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

The same step is recorded (:func:`mgtutor.parallel.comms.record_comms`, each call's
process group told by its name) and set beside :func:`mgtutor.plan.planner.plan` for the same
layout and a :class:`~mgtutor.plan.shape.Transformer` of the tiny model's shape, axis by axis.
Where the hand run and the planner's model differ by design, what is comparable is compared:

* dp: the hand run all-reduces each parameter's gradient apart (one call per tensor, 16 on a
  rank's shard of a block) where the planner counts DDP's one bucket: the buffers' elements
  summed and the elements sent must equal the plan's one all-reduce; the calls are not compared.
* tp: the planner's 4 all-reduces of b·s·h per layer per micro-batch (Megatron's f and g in
  attention and MLP, forward and backward): calls, elements and elements sent compared.
* pp: ``HandStage`` sends on the default group to its pp peers' global ranks (the peers are
  checked by ``test_each_stage_talks_to_its_pipeline_groups_ranks``), so a send on the default
  group counts on the pp axis. Each stage sends m messages of b·s·h (2(p-1)m in the pipeline);
  the planner plans the first stage's m: every rank is compared with it. Receives send nothing.
* The run is in float64 (to equal one process exactly), the plan in float32: elements are
  compared, not bytes. The tiny model has no embedding (vocab 0), and groups of one rank (tp
  in dp x pp) are left out: torch still calls them, they send nothing, the planner skips them.
* The loss's all-reduce for the report is outside the recorded step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mgtutor
from mgtutor.experiments.traffic import totals
from mgtutor.parallel import tensor as tp
from mgtutor.parallel.comms import record_comms
from mgtutor.parallel.layout import AXES, Layout, build_groups
from mgtutor.parallel.pipeline import HandStage, gpipe_order, run_order
from mgtutor.plan.planner import Plan, plan
from mgtutor.plan.shape import Transformer

DIM, HEADS, HIDDEN, BATCH, SEQ = 8, 4, 16, 4, 4  # BATCH: the global batch, split over dp
N_MICRO, TOLERANCE = 2, 1e-10
RUN_BYTES, PLAN_BYTES = 8, 4  # float64 in the run, float32 ("fp32") in the plan
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
    with record_comms() as calls:
        run_order(stage, gpipe_order(N_MICRO), mine.chunk(N_MICRO), targets.chunk(N_MICRO))
        average = getattr(groups, f"{average_over}_group")
        for p in block.parameters():
            dist.all_reduce(p.grad, group=average)
            p.grad /= layout.dp
    axis_of = {getattr(groups, f"{axis}_group").group_name: axis for axis in AXES}
    by_axis = [
        (axis_of.get(c.group, "pp" if c.op == "send" else "default"), c)
        for c in calls
        if c.op != "recv" and c.group_size > 1
    ]
    loss = None
    if stage.is_last:
        value = torch.stack(stage.losses).sum()
        dist.all_reduce(value, group=groups.dp_group)
        loss = value.item() / layout.dp
    return {"loss": loss, "block": block, "sent": stage.sent, "calls": by_axis}


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
            "calls": step["calls"],
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


def _planned(layout: Layout, **changes: Any) -> Plan:
    """The planner's step for the tiny model on ``layout`` (``changes``: a counterfactual)."""
    b = BATCH // layout.dp // N_MICRO
    shape = Transformer(layers=2, hidden=DIM, heads=HEADS, seq_len=SEQ, micro_batch=b, ffn=HIDDEN)
    options = {"layout": layout, "micro_batches": N_MICRO, "schedule": "GPipe", **changes}
    return plan(shape, layout.world_size, 10**9, precision="fp32", **options)


def _differences(calls: list, planned: Plan) -> list[str]:
    """Per axis, where one rank's recorded step and the plan differ (elements, see the module)."""
    wrong = []
    for axis in ("dp", "tp", "pp", "default"):
        ran = [c for where, c in calls if where == axis]
        got = (len(ran), sum(c.buffer for c in ran), sum(c.sent for c in ran))
        got = (got[0], got[1] // RUN_BYTES, got[2] // RUN_BYTES)
        summed = totals(c for c in planned.collectives if c.group == axis).values()
        want = tuple(sum(t[i] for t in summed) for i in range(3))
        want = (want[0], want[1] // PLAN_BYTES, want[2] // PLAN_BYTES)
        if axis == "dp" and got[0]:  # one call per parameter tensor, not DDP's one bucket
            got = (want[0], *got[1:])
        if got != want:
            wrong.append(f"{axis}: ran (calls, elements, elements sent) {got}, planned {want}")
    return wrong


def test_each_axis_sends_what_the_plan_says(measured) -> None:
    layout, results = measured
    planned = _planned(layout)
    for rank, result in enumerate(results):
        assert _differences(result["dp"]["calls"], planned) == [], f"rank {rank}"


def test_the_comparison_misses_a_wrong_group_or_a_wrong_plan(measured) -> None:
    layout, results = measured
    calls = results[0]["dp"]["calls"]
    # Averaged over tp instead of dp: nothing on the dp axis, the gradients on tp.
    assert any(
        d.startswith("dp:") for d in _differences(results[0]["tp"]["calls"], _planned(layout))
    )
    # A plan with one micro-batch: half the pipeline's sends (and half tp's calls).
    assert any(d.startswith("pp:") for d in _differences(calls, _planned(layout, micro_batches=1)))
    if layout.tp > 1:  # planned without tensor parallelism: no tp calls, whole layers
        other = Layout(dp=layout.dp, pp=layout.pp)
        assert any(d.startswith("tp:") for d in _differences(calls, _planned(other)))
