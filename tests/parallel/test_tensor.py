"""mgtutor.parallel.tensor: layers split by hand equal one process, with the collectives counted.

One launch of 2 ranks (``measured``, cached for the module) runs every check that needs a
process group: the four autograd functions on small tensors, a transformer block split for
tensor and for sequence parallelism against the same block in one process (outputs and every
gradient), the collectives each ran, torch's ``parallelize_module`` on the same block with the
collectives recorded by ``record_comms`` and, from torch 2.14 (before it, it fails around
module hooks), counted by torch's ``CommDebugMode`` too, the activations each keeps, and
``memplan.estimate(strategy="tp")`` against ``breakdown.breakdown`` of the ranks; the tests below
each read their part.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import mgtutor
from mgtutor.build import torch_release
from mgtutor.measure import breakdown as breakdown_module
from mgtutor.measure.activations import LiveTensors
from mgtutor.parallel import tensor as tp
from mgtutor.parallel.comms import by_kind, comm_counts, record_comms
from mgtutor.parallel.tensor_comms import (
    copy_to_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
)
from mgtutor.plan import memplan

DIM, HEADS, HIDDEN, BATCH, SEQ = 16, 4, 64, 2, 8
COMM_DEBUG_MODE_WORKS = torch_release() >= (2, 14)  # IndexError in _fw_set_module_hook before
SEQ_BYTES = BATCH * SEQ * DIM * 8  # one float64 activation of the whole sequence


def _reference() -> tuple[tp.Block, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    block = tp.Block(DIM, HEADS, HIDDEN).double()
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)
    out = block(x)
    out.pow(2).sum().backward()
    return block, x, out.detach()


def _functions(rank: int, world: int) -> dict[str, Any]:
    """Each function's forward value and the gradient it hands back, on small tensors."""
    out = {}
    for name, fn, shape in (
        ("f", copy_to_parallel, (2, 4, 3)),
        ("g", reduce_from_parallel, (2, 4, 3)),
        ("gather", gather_from_sequence, (2, 2, 3)),
        ("scatter", reduce_scatter_to_sequence, (2, 4, 3)),
    ):
        x = torch.full(shape, float(rank + 1), dtype=torch.float64, requires_grad=True)
        with record_comms() as calls:
            y = fn(x)
            (y * (rank + 1)).sum().backward()  # a different upstream gradient on each rank
        out[name] = {
            "y": y.detach(),
            "grad": x.grad,
            "calls": [(c.op, c.phase, c.buffer) for c in calls],
        }
    return out


def _split_blocks(block, x, ref, rank, world) -> dict[str, Any]:
    out = {}
    for sp in (False, True):
        parallel = tp.ParallelBlock(block, sequence_parallel=sp)
        mine = x.chunk(world, 1)[rank] if sp else x
        with record_comms() as calls:
            y = parallel(mine)
            y.pow(2).sum().backward()
            unsynced = tp.gradient_errors(block, parallel)
            if sp:
                tp.all_reduce_replicated_grads(parallel)
        label = "sp" if sp else "tp"
        out[label] = {
            "out": (y - (ref.chunk(world, 1)[rank] if sp else ref)).abs().max().item(),
            "grads": tp.gradient_errors(block, parallel),
            "unsynced": unsynced,
            "calls": [(c.op, c.phase, c.buffer) for c in calls],
            "shards": tp.shard_of(parallel),
        }
    return out


def _collective_not_run() -> list[str]:
    """g with its all-reduce skipped: what the recorder saw (a self-report would say one)."""
    import torch.distributed as dist

    run = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: None
    try:
        with record_comms() as calls:
            reduce_from_parallel(torch.ones(3))
    finally:
        dist.all_reduce = run
    return [c.op for c in calls]


def _activations(rank, world) -> dict[str, int]:
    """Bytes a forward keeps for backward, float32, dropout on, tensor against sequence parallel."""
    torch.manual_seed(0)
    block = tp.Block(DIM, HEADS, HIDDEN, p=0.1)
    x = torch.randn(BATCH, SEQ, DIM)
    out = {}
    for label, sp in (("tp", False), ("sp", True)):
        parallel = tp.ParallelBlock(block, sequence_parallel=sp)
        mine = x.chunk(world, 1)[rank] if sp else x
        with LiveTensors() as live:
            loss = parallel(mine).sum()
            out[label] = live.live_bytes()
            loss.backward()
    return out


def _torch_way(block, x, ref, rank, world) -> dict[str, Any] | str:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )
    except ImportError as error:
        return f"torch {torch.__version__} has no public DTensor API ({error})"
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for label in ("tp", "tp per linear", "sp"):
        model = copy.deepcopy(block)
        model.zero_grad()
        plan = {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.up")}
        if label == "sp":
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
            plan.update({"attn": gather, "mlp": copy.deepcopy(gather)})
            plan.update(
                {n: RowwiseParallel(output_layouts=Shard(1)) for n in ("attn.o", "mlp.down")}
            )
        else:
            plan.update({"attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()})
        if label == "tp":  # q, k and v share one input DTensor, so one gradient all-reduce
            plan["attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            )
        parallelize_module(model, mesh, plan)
        model.attn.n_heads //= world
        mine = x.chunk(world, 1)[rank] if label == "sp" else x
        with record_comms() as comms, _comm_debug_mode() as comm:
            y = model(mine)
            forward = comm_counts(comms)
            torch_forward = comm and _operators(comm.get_comm_counts())
            y.pow(2).sum().backward()
        total = comm_counts(comms)
        torch_total = comm and _operators(comm.get_comm_counts())
        full = dict(block.named_parameters())
        errors = {}
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            errors[name] = (grad - full[name].grad).abs().max().item()
        want = ref.chunk(world, 1)[rank] if label == "sp" else ref
        out[label] = {
            "out": (y - want).abs().max().item(),
            "grads": errors,
            "forward": forward,
            "total": total,
            "CommDebugMode": comm and {"forward": torch_forward, "total": torch_total},
            "placements": {
                n: _placements(p) for n, p in model.named_parameters() if hasattr(p, "placements")
            },
        }
    # After the "sp" backward the norms' gradients are Partial: each step reads them again.
    out["sp"]["partial"] = [
        n for n, p in model.named_parameters() if p.grad.placements[0].is_partial()
    ]
    for name, make in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam)):
        opt = make(model.parameters(), lr=0.01)
        # Each counter alone: under CommDebugMode, which lets DTensor run first, an outer
        # counter would see the collectives whatever it does itself.
        with record_comms() as comms:
            opt.step()
        with _comm_debug_mode() as comm:
            opt.step()
        out["sp"][name] = {
            "counter": comm_counts(comms),
            "CommDebugMode": comm and _operators(comm.get_comm_counts()),
        }
    # memplan's estimate against what a rank holds after an Adam step
    model = copy.deepcopy(block).float()
    tp_plan = {
        "attn.q": "colwise",
        "attn.k": "colwise",
        "attn.v": "colwise",
        "attn.o": "rowwise",
        "mlp.up": "colwise",
        "mlp.down": "rowwise",
    }
    estimate = memplan.estimate(
        model, optimizer="adam", world_size=world, strategy="tp", tp_plan=tp_plan
    )[rank]
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {n: styles[s]() for n, s in tp_plan.items()})
    model.attn.n_heads //= world
    opt = torch.optim.Adam(model.parameters())
    model(x.float()).sum().backward()
    opt.step()
    out["memory"] = (estimate, breakdown_module.breakdown(model, opt))
    return out


def _comm_debug_mode():
    """torch's own counter where it works around module hooks (2.14+), else nothing."""
    if not COMM_DEBUG_MODE_WORKS:
        return contextlib.nullcontext()
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


def _operators(counts) -> dict[str, int]:
    """CommDebugMode's counts by operator, named as ``Comm.operator`` names them.

    torch 2.14's CommDebugMode counts the native ``_c10d_functional.all_reduce``, which DTensor
    runs, under the legacy ``c10d_functional.all_reduce`` (its NATIVE_TO_PY_MAPPING).
    """
    out: dict[str, int] = {}
    for op, n in counts.items():
        name = str(op)
        if n:
            out["_" + name if name.startswith("c10d_functional.") else name] = n
    return out


def _placements(p) -> tuple[tuple[Any, ...], ...]:
    """A DTensor's placements by what they are, not by their repr."""

    def what(pl) -> tuple[Any, ...]:
        if pl.is_shard():
            return ("shard", pl.dim)
        return ("replicate",) if pl.is_replicate() else ("partial", pl.reduce_op)

    return tuple(what(pl) for pl in p.placements)


def _without_bias(rank, world) -> dict[str, float]:
    """An MLP of bias-free linears, split: output and gradients against one process."""
    torch.manual_seed(1)
    mlp = tp.MLP(DIM, HIDDEN).double()
    mlp.up, mlp.down = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)
    mlp.double()
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)
    full = mlp(x)
    full.pow(2).sum().backward()
    parallel = tp.ParallelMLP(mlp)
    y = parallel(x)
    y.pow(2).sum().backward()
    return {"out": (y - full).abs().max().item(), **tp.gradient_errors(mlp, parallel)}


def _errors(world) -> dict[str, str]:
    out = {}
    for label, make in (
        ("heads", lambda: tp.HeadParallelAttention(tp.Attention(12, 3))),
        ("features", lambda: tp.ColumnParallelLinear(nn.Linear(4, 3))),
        ("sequence", lambda: reduce_scatter_to_sequence(torch.zeros(1, 3, 2))),
    ):
        try:
            make()
            out[label] = "no error"
        except ValueError as error:
            out[label] = str(error)
    return out


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    mgtutor.setup(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    block, x, ref = _reference()
    return {
        "functions": _functions(rank, world),
        "blocks": _split_blocks(block, x, ref, rank, world),
        "torch": _torch_way(block, x, ref, rank, world),
        "activations": _activations(rank, world),
        "errors": _errors(world),
        "without bias": _without_bias(rank, world),
        "not run": _collective_not_run(),
        "params": {n: p.numel() for n, p in block.named_parameters()},
    }


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    return mgtutor.launch(_worker, world_size=2, timeout=120).results


def test_f_copies_forward_and_all_reduces_backward(measured):
    # rank r holds r + 1 everywhere and scales its output by r + 1: gradients 1 and 2.
    for rank, result in enumerate(measured):
        f = result["functions"]["f"]
        assert torch.equal(f["y"], torch.full((2, 4, 3), rank + 1.0, dtype=torch.float64))
        assert torch.equal(f["grad"], torch.full((2, 4, 3), 3.0, dtype=torch.float64))
        assert f["calls"] == [("all_reduce", "backward", 2 * 4 * 3 * 8)]


def test_g_all_reduces_forward_and_copies_backward(measured):
    for rank, result in enumerate(measured):
        g = result["functions"]["g"]
        assert torch.equal(g["y"], torch.full((2, 4, 3), 3.0, dtype=torch.float64))
        assert torch.equal(g["grad"], torch.full((2, 4, 3), rank + 1.0, dtype=torch.float64))
        assert g["calls"] == [("all_reduce", "forward", 2 * 4 * 3 * 8)]


def test_sequence_pair_gathers_and_reduce_scatters_along_dim_1(measured):
    for result in measured:
        gather, scatter = result["functions"]["gather"], result["functions"]["scatter"]
        # all-gather along the sequence: rank 0's two positions, then rank 1's
        assert gather["y"].shape == (2, 4, 3)
        assert torch.equal(gather["y"][:, :, 0], torch.tensor([[1.0, 1, 2, 2]] * 2).double())
        # its backward reduce-scatters: every rank's upstream gradient (1 and 2) summed
        assert torch.equal(gather["grad"], torch.full((2, 2, 3), 3.0, dtype=torch.float64))
        assert gather["calls"] == [
            ("all_gather", "forward", 2 * 4 * 3 * 8),
            ("reduce_scatter", "backward", 2 * 4 * 3 * 8),
        ]
        assert torch.equal(scatter["y"], torch.full((2, 2, 3), 3.0, dtype=torch.float64))
        assert torch.equal(scatter["grad"][:, :2], torch.full((2, 2, 3), 1.0).double())
        assert torch.equal(scatter["grad"][:, 2:], torch.full((2, 2, 3), 2.0).double())
        assert scatter["calls"] == [
            ("reduce_scatter", "forward", 2 * 4 * 3 * 8),
            ("all_gather", "backward", 2 * 4 * 3 * 8),
        ]


@pytest.mark.parametrize("mode", ["tp", "sp"])
def test_split_block_equals_one_process(measured, mode):
    for result in measured:
        block = result["blocks"][mode]
        assert block["out"] < 1e-12
        assert set(block["grads"]) == set(result["params"])
        assert max(block["grads"].values()) < 1e-12, block["grads"]


def test_sequence_parallel_needs_the_replicated_gradients_summed(measured):
    for result in measured:
        unsynced = result["blocks"]["sp"]["unsynced"]
        assert unsynced["norm1.weight"] > 1e-3 and unsynced["mlp.down.bias"] > 1e-3
        assert unsynced["mlp.up.weight"] < 1e-12  # the split weights never needed it
        assert max(result["blocks"]["tp"]["unsynced"].values()) < 1e-12


def test_the_recorder_does_not_count_a_collective_that_did_not_run(measured):
    for result in measured:
        assert result["not run"] == []


def test_collectives_per_block(measured):
    replicated = (4 * DIM + 2 * DIM) * 8  # two norms (weight, bias), two row-parallel biases
    for result in measured:
        assert result["blocks"]["tp"]["calls"] == [
            ("all_reduce", "forward", SEQ_BYTES),
            ("all_reduce", "forward", SEQ_BYTES),
            ("all_reduce", "backward", SEQ_BYTES),
            ("all_reduce", "backward", SEQ_BYTES),
        ]
        gather, scatter = (
            ("all_gather", "forward", SEQ_BYTES),
            ("reduce_scatter", "forward", SEQ_BYTES),
        )
        back = [("all_gather", "backward", SEQ_BYTES), ("reduce_scatter", "backward", SEQ_BYTES)]
        assert result["blocks"]["sp"]["calls"] == [
            gather,
            scatter,
            gather,
            scatter,
            *back,
            *back,
            ("all_reduce", "forward", replicated),  # after backward, by all_reduce_replicated_grads
        ]


def test_each_rank_holds_its_own_rows_and_columns(measured):
    rows = [result["blocks"]["tp"]["shards"]["mlp.up.weight"]["rows"] for result in measured]
    cols = [result["blocks"]["tp"]["shards"]["mlp.down.weight"]["cols"] for result in measured]
    assert rows == [(0, HIDDEN // 2), (HIDDEN // 2, HIDDEN)]
    assert cols == [(0, HIDDEN // 2), (HIDDEN // 2, HIDDEN)]
    shards = measured[0]["blocks"]["tp"]["shards"]
    assert shards["attn.o.weight"]["shape"] == (DIM, DIM // 2)
    assert shards["attn.q.bias"] == {"rows": (0, DIM // 2), "cols": None, "shape": (DIM // 2,)}
    assert shards["attn.o.bias"] == {"rows": None, "cols": None, "shape": (DIM,)}


def _needs_dtensor(measured):
    if isinstance(measured[0]["torch"], str):
        pytest.skip(measured[0]["torch"])


@pytest.mark.parametrize("mode", ["tp", "tp per linear", "sp"])
def test_torch_parallelize_module_equals_one_process(measured, mode):
    _needs_dtensor(measured)
    for result in measured:
        run = result["torch"][mode]
        assert run["out"] < 1e-12
        assert max(run["grads"].values()) < 1e-12, run["grads"]


def test_torch_runs_the_collectives_written_by_hand(measured):
    _needs_dtensor(measured)
    for result in measured:
        torch_way, hand = result["torch"], result["blocks"]
        assert by_kind(torch_way["tp"]["forward"]) == {"all_reduce": 2}
        assert by_kind(torch_way["tp"]["total"]) == by_kind_of(hand["tp"]["calls"])
        # One PrepareModuleInput less: q, k and v each all-reduce their input's gradient.
        assert by_kind(torch_way["tp per linear"]["total"]) == {"all_reduce": 6}
        # torch leaves the norms' gradients Partial(sum): reduced when used, not in backward.
        assert by_kind(torch_way["sp"]["total"]) == {"all_gather": 4, "reduce_scatter": 4}
        assert by_kind_of(hand["sp"]["calls"]) == {
            "all_gather": 4,
            "reduce_scatter": 4,
            "all_reduce": 1,
        }
        assert torch_way["sp"]["placements"]["norm1.weight"] == (("replicate",),)
        assert torch_way["sp"]["placements"]["attn.o.weight"] == (("shard", 1),)


@pytest.mark.skipif(
    not COMM_DEBUG_MODE_WORKS,
    reason=f"torch {torch.__version__}: CommDebugMode raises IndexError around module hooks "
    "(torch 2.11 to 2.13) or is not checked (before 2.14)",
)
@pytest.mark.parametrize("mode", ["tp", "tp per linear", "sp"])
def test_record_comms_counts_by_operator_what_comm_debug_mode_counts(measured, mode):
    # torch's own counter checks ours, operator by operator, forward and forward + backward.
    _needs_dtensor(measured)
    for result in measured:
        run = result["torch"][mode]
        assert run["CommDebugMode"] == {"forward": run["forward"], "total": run["total"]}
        assert run["forward"] != run["total"]  # backward ran collectives, and both counted them


def test_collective_counter_sees_the_sums_an_optimizer_step_runs_on_partial_gradients(measured):
    _needs_dtensor(measured)
    for result in measured:
        sp = result["torch"]["sp"]
        assert sp["partial"] == ["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"]
        # Summed at every read: SGD's add_ once, Adam's lerp_ and addcmul_(grad, grad) thrice.
        assert by_kind(sp["sgd"]["counter"]) == {"all_reduce": 4}
        assert by_kind(sp["adam"]["counter"]) == {"all_reduce": 12}
        if COMM_DEBUG_MODE_WORKS:
            assert sp["sgd"]["CommDebugMode"] == sp["sgd"]["counter"]
            assert sp["adam"]["CommDebugMode"] == sp["adam"]["counter"]


def by_kind_of(calls):
    return dict(Counter(op for op, _, _ in calls))


def test_torch_counts_match_mgtutor_counts_of_the_same_collectives():
    counts = {
        "c10d.allreduce_": 2,
        "c10d_functional.all_reduce": 1,
        "c10d._allgather_base_": 3,
        "c10d_functional.reduce_scatter_tensor": 4,
    }
    assert by_kind(counts) == {"all_reduce": 3, "all_gather": 3, "reduce_scatter": 4}


def test_sequence_parallel_keeps_fewer_activations(measured):
    for result in measured:
        kept = result["activations"]
        assert kept["sp"] < kept["tp"], kept


def test_memplan_tp_estimate_equals_the_ranks(measured):
    _needs_dtensor(measured)
    for result in measured:
        estimate, breakdown = result["torch"]["memory"]
        for category in ("parameters", "gradients", "optimizer_state", "communication"):
            assert getattr(estimate, category) == getattr(breakdown, category), category


def test_memplan_tp_splits_with_torch_chunk_unpadded():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    ranks = memplan.estimate(
        model,
        optimizer="sgd",
        world_size=3,
        strategy="tp",
        tp_plan={"0": "colwise", "1": "rowwise"},
    )
    # rows of 0 (5 of them) split 2, 2, 1; columns of 1 likewise; 1.bias (4) stays whole
    held = [(r * 4 + r) + (4 * r) + 4 for r in (2, 2, 1)]
    assert [b.parameters for b in ranks] == [4 * h for h in held]
    assert [b.optimizer_state for b in ranks] == [0, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tp_plan": {"0": "columns"}}, "must be one of"),
        ({"tp_plan": {"1": "colwise"}}, "ReLU, not an nn.Linear"),
    ],
)
def test_memplan_tp_refuses_a_wrong_plan(kwargs, words):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=words):
        memplan.estimate(model, world_size=2, strategy="tp", **kwargs)
    with pytest.raises(ValueError, match="needs the module"):
        memplan.estimate(100, world_size=2, strategy="tp")


def test_shapes_that_do_not_split_are_refused_with_what_to_do(measured):
    errors = measured[0]["errors"]
    assert "3 heads cannot be split evenly over 2 ranks" in errors["heads"]
    assert "shape (3,)" in errors["features"] or "shape (3, 4)" in errors["features"]
    assert "multiples of the world size" in errors["features"]
    assert "make the sequence a multiple of 2" in errors["sequence"]


def test_linears_without_bias_split_too(measured):
    for result in measured:
        errors = result["without bias"]
        assert set(errors) == {"out", "up.weight", "down.weight"}
        assert max(errors.values()) < 1e-12, errors


@pytest.mark.parametrize(
    "make", [lambda: tp.ColumnParallelLinear(nn.Linear(4, 4), enter="gathr"),
             lambda: tp.RowParallelLinear(nn.Linear(4, 4), leave="scater")],
    ids=["enter", "leave"],
)
def test_a_misspelt_option_is_refused_before_anything_runs(make):
    # Before the check "gathr" ran the layer with no collective and "scater" all-reduced.
    with pytest.raises(ValueError, match="is not one of"):
        make()
