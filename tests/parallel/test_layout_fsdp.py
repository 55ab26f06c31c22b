"""FSDP inside a layout: dp x tp on 4 gloo ranks, each tp shard sharded over its dp group.

One launch of 4 gloo ranks (``measured``, cached for the module) builds
``build_groups(Layout(dp=2, tp=2))``. Each tensor-parallel pair splits the same seeded
:class:`~mgtutor.parallel.tensor.Block` over its tp group; FSDP2's ``fully_shard`` then shards
each rank's :class:`~mgtutor.parallel.tensor.ParallelBlock` over a ``DeviceMesh`` made from the
layout's dp group (``DeviceMesh.from_group``), as torchtitan applies tp first, then FSDP on
the dp mesh. The block is a non-root unit under a root that owns no parameters (as
:func:`mgtutor.experiments.traffic.count_steps` wraps its layers): it reshards after forward, so
each micro-batch all-gathers it twice on every torch that has ``fully_shard``.

Each data-parallel replica takes its half of a seeded global batch for one forward and
backward. In float64 the loss and every gradient (gathered back to the tp shard's full tensor)
must equal one process on the whole batch. The same launch shards over tp instead, which must
miss. Against :func:`mgtutor.plan.planner.plan` for the same layout and a
:class:`~mgtutor.plan.shape.Transformer` of the tiny block's shape (one layer, no embedding):

* memory: the parameter elements a rank holds after backward (its FSDP shards) equal the plan's
  ``memory["parameters"]`` under ZeRO-3; unsharded (what DDP holds, ZeRO-0) they equal the
  plan's for ZeRO-0, so the two checks tell the stages apart. Its gradient shards and, after
  one Adam step, its two moments equal ``memory["gradients"]`` and
  ``memory["optimizer_state"]`` (ZeRO-1's plan, whole gradients, would miss). Not compared
  here: the plan's transient (a unit gathered with its gradients) and its activations.
* dp: the plan's ZeRO-3 row, two all-gathers and one reduce-scatter of the tp shard per
  micro-batch: calls and elements per call compared. FSDP2 pads each parameter's first
  dimension to a multiple of dp where the plan counts ceil(M/dp) elements; every first
  dimension of this block is even, so the two agree exactly (notebook 17 names the padding).
* tp: the plan's 4 all-reduces of b·s·h per layer per micro-batch (Megatron's f and g).
* The run is in float64, the plan in float32: elements are compared, not bytes.
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
from mgtutor.parallel.comms import Comm, record_comms
from mgtutor.parallel.layout import Layout, build_groups
from mgtutor.plan.planner import Plan, plan
from mgtutor.plan.shape import Transformer

try:
    from torch.distributed.fsdp import fully_shard  # public from torch 2.6
except ImportError:
    fully_shard = None

pytestmark = pytest.mark.skipif(
    fully_shard is None,
    reason=f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (2.6 has)",
)

DIM, HEADS, HIDDEN, BATCH, SEQ = 8, 4, 16, 4, 4  # BATCH: the global batch, split over dp
TOLERANCE = 1e-10
RUN_BYTES, PLAN_BYTES = 8, 4  # float64 in the run, float32 ("fp32") in the plan
LAYOUT = Layout(dp=2, tp=2)


def _reference(block: tp.Block, x: torch.Tensor) -> tuple[tp.Block, float]:
    """One process, the whole global batch: the loss and, in the copy, every gradient."""
    whole = copy.deepcopy(block)
    loss = whole(x).pow(2).mean()
    loss.backward()
    return whole, loss.item()


def _one_step(block: tp.Block, x: torch.Tensor, groups, shard_over: str) -> dict[str, Any]:
    """One forward and backward of this rank's tp shard, FSDP-sharded over ``shard_over``."""
    from torch.distributed.device_mesh import DeviceMesh

    parallel = tp.ParallelBlock(block, group=groups.tp_group)
    unsharded = tp.ParallelBlock(block, group=groups.tp_group)  # what DDP holds; for the grads
    mesh = DeviceMesh.from_group(getattr(groups, f"{shard_over}_group"), "cpu")
    fully_shard(parallel, mesh=mesh)
    root = fully_shard(nn.Sequential(parallel), mesh=mesh)
    mine = x.chunk(LAYOUT.dp, 0)[groups.dp_rank]  # this replica's half of the batch
    with record_comms() as calls:
        loss = root(mine).pow(2).sum() / mine.numel()
        loss.backward()
    for sharded, whole_shard in zip(parallel.parameters(), unsharded.parameters()):
        whole_shard.grad = sharded.grad.full_tensor()
    grads = sum(p.grad.to_local().numel() for p in parallel.parameters())
    adam = torch.optim.Adam(parallel.parameters())  # its state: 2 tensors per parameter
    adam.step()  # on the shards: no collective
    moments = sum(
        state[name].to_local().numel()
        for state in adam.state.values()
        for name in ("exp_avg", "exp_avg_sq")
    )
    value = loss.detach().clone()
    dist.all_reduce(value, group=groups.dp_group)
    axis_of = {groups.dp_group.group_name: "dp", groups.tp_group.group_name: "tp"}
    return {
        "loss": value.item() / LAYOUT.dp,
        "unsharded": unsharded,
        "held": sum(p.to_local().numel() for p in parallel.parameters()),
        "grads_held": grads,
        "moments_held": moments,
        "mesh_ranks": dist.get_process_group_ranks(mesh.get_group()),
        "calls": [(axis_of.get(c.group, "other"), c) for c in calls],
    }


def _worker() -> dict[str, Any]:
    mgtutor.setup(backend="gloo")
    groups = build_groups(LAYOUT)
    torch.manual_seed(0)
    block = tp.Block(DIM, HEADS, HIDDEN).double()
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)
    whole, loss = _reference(block, x)
    runs = {}
    for shard_over in ("dp", "tp"):
        step = _one_step(block, x, groups, shard_over)
        runs[shard_over] = {
            "loss": abs(step["loss"] - loss),
            "grads": tp.gradient_errors(whole, step["unsharded"]),
            "held": step["held"],
            "grads_held": step["grads_held"],
            "moments_held": step["moments_held"],
            "unsharded": sum(p.numel() for p in step["unsharded"].parameters()),
            "mesh_ranks": step["mesh_ranks"],
            "calls": step["calls"],
        }
    return {"dp_ranks": groups.dp_ranks, **runs}


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    run = mgtutor.launch(_worker, world_size=LAYOUT.world_size, backend="gloo", timeout=120)
    return run.results


def _planned(zero: int) -> Plan:
    """The planner's step for the tiny block on the layout, under ZeRO stage ``zero``."""
    b = BATCH // LAYOUT.dp
    shape = Transformer(layers=1, hidden=DIM, heads=HEADS, seq_len=SEQ, micro_batch=b, ffn=HIDDEN)
    return plan(shape, LAYOUT.world_size, 10**9, layout=LAYOUT, zero=zero, precision="fp32")


def _differences(calls: list[tuple[str, Comm]], planned: Plan) -> list[str]:
    """Per axis, where one rank's calls and the plan's differ: (name, ranks, calls, elements)."""
    wrong = []
    for axis in ("dp", "tp", "other"):
        ran: dict[tuple[str, int, int], int] = {}
        for where, c in calls:
            if where == axis:
                key = (c.op, c.group_size, c.buffer // RUN_BYTES)
                ran[key] = ran.get(key, 0) + 1
        want = {
            (c.name, c.size, c.buffer_bytes // PLAN_BYTES): c.calls
            for c in planned.collectives
            if c.group == axis
        }
        if ran != want:
            wrong.append(f"{axis}: ran {ran}, planned {want} ((name, ranks, elements): calls)")
    return wrong


def test_fsdp_shards_over_the_layouts_dp_group(measured) -> None:
    for rank, result in enumerate(measured):
        assert result["dp"]["mesh_ranks"] == result["dp_ranks"], f"rank {rank}"
        assert result["dp_ranks"] in LAYOUT.group_ranks("dp"), f"rank {rank}"


def test_fsdp_in_a_layout_equals_one_process_on_the_whole_batch(measured) -> None:
    for rank, result in enumerate(measured):
        run = result["dp"]
        assert run["loss"] < TOLERANCE, f"rank {rank}: loss off by {run['loss']}"
        wrong = {name: e for name, e in run["grads"].items() if not e < TOLERANCE}
        assert run["grads"] and not wrong, f"rank {rank}: gradients off: {wrong}"


def test_sharding_over_tp_instead_of_dp_misses(measured) -> None:
    # The check above can fail: over tp, FSDP averages the two halves of each split weight.
    worst = max(max(result["tp"]["grads"].values()) for result in measured)
    assert worst > 1e-3, f"sharded over tp, gradients within {worst} of one process"


def test_each_rank_holds_the_planned_parameters(measured) -> None:
    sharded, unsharded = (_planned(zero).memory["parameters"] // PLAN_BYTES for zero in (3, 0))
    for rank, result in enumerate(measured):
        assert result["dp"]["held"] == sharded, f"rank {rank}: FSDP shards against ZeRO-3"
        assert result["dp"]["unsharded"] == unsharded, f"rank {rank}: tp shard against ZeRO-0"


def test_each_rank_holds_the_planned_gradients_and_adam_state(measured) -> None:
    # float32 in the plan: 4 bytes a gradient element, 8 an Adam parameter's two moments. FSDP
    # (ZeRO-3) keeps 1/dp of each; ZeRO-0's plan, whole ones, is the other count, not met.
    planned, whole = _planned(3).memory, _planned(0).memory
    grads, moments = planned["gradients"] // PLAN_BYTES, planned["optimizer_state"] // PLAN_BYTES
    assert (grads, moments) != (
        whole["gradients"] // PLAN_BYTES,
        whole["optimizer_state"] // PLAN_BYTES,
    )
    for rank, result in enumerate(measured):
        assert result["dp"]["grads_held"] == grads, f"rank {rank}: gradient shards"
        assert result["dp"]["moments_held"] == moments, f"rank {rank}: Adam's state"


def test_each_axis_sends_what_the_plan_says(measured) -> None:
    planned = _planned(3)
    for rank, result in enumerate(measured):
        dp_calls = {c.op for where, c in result["dp"]["calls"] if where == "dp"}
        assert dp_calls == {"all_gather", "reduce_scatter"}, f"rank {rank}"
        assert _differences(result["dp"]["calls"], planned) == [], f"rank {rank}"
