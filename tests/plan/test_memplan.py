"""memplan: the measured breakdown equals the calculator, byte for byte, on CPU ranks."""

from __future__ import annotations

import dataclasses
import pickle

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn

import mgtutor
from mgtutor.build import torch_release
from mgtutor.measure import breakdown as breakdown_module
from mgtutor.measure import plots
from mgtutor.plan import memplan

CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication")

# memplan's rules are read from torch 2.14's DDP, ZeroRedundancyOptimizer and FSDP2, for the
# notebooks' torch: not run on the floor. (A ZeRO rank once stuck exiting there was torch's
# destroy-time GIL deadlock, which mgtutor.worker.keep_destroyed_groups now avoids.)
pytestmark = pytest.mark.skipif(
    torch_release() < (2, 6),
    reason=f"memplan models the notebooks' torch (>= 2.6), not {torch.__version__}",
)


def odd_model() -> nn.Sequential:
    """Shapes that do not split evenly over 2 ranks, so FSDP's padding and ZeRO's greedy split
    both show (weights 5x6 and 3x5, biases 5 and 3)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for step in range(steps):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def three_strategies() -> dict:
    """In each rank: DDP (copied and bucket-view gradients), DDP + ZeRO-1 and FSDP2, measured."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    mgtutor.setup()
    out = {}
    for name, view in (("ddp", False), ("ddp_view", True)):
        ddp = DDP(odd_model(), gradient_as_bucket_view=view)
        opt = torch.optim.Adam(ddp.parameters())
        train(ddp, opt)
        out[name] = breakdown_module.breakdown(ddp, opt)
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        out[name + "_zeros_like_buckets"] = sum(b.buffer().nbytes for b in buckets)
    ddp = DDP(odd_model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam)
    train(ddp, zero)
    params = list(ddp.parameters())
    mine = zero._partition_parameters()[dist.get_rank()][0]["params"]
    out["zero_owned"] = [i for i, p in enumerate(params) if any(p is q for q in mine)]
    breakdown_module.track(ddp.module, zero, ddp=ddp)
    out["zero1"] = breakdown_module.tracked_breakdown()
    out["tracked_again"] = breakdown_module.tracked_breakdown()  # kept, for a pool's later calls
    breakdown_module.clear_tracked()
    try:
        from torch.distributed.fsdp import fully_shard  # public from torch 2.6
    except ImportError:
        out["fsdp"] = None  # torch 2.4's FSDP2 was private and is not what memplan models
        out["fsdp_missing"] = f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
        return out
    model = odd_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt)
    out["fsdp"] = breakdown_module.breakdown(model, opt)
    return out


def needs_fsdp(measured: list[dict]) -> None:
    if measured[0]["fsdp"] is None:
        pytest.skip(measured[0]["fsdp_missing"])


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return mgtutor.launch(three_strategies, world_size=2).results


def categories(b: memplan.MemoryBreakdown) -> dict[str, int]:
    return {c: getattr(b, c) for c in CATEGORIES}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_calculator_matches_measured_ranks_exactly(measured, strategy):
    if strategy == "fsdp":
        needs_fsdp(measured)
    model = odd_model()
    units = [model[0]] if strategy == "fsdp" else None
    expected = memplan.estimate(
        model, optimizer="adam", world_size=2, strategy=strategy, fsdp_units=units
    )
    for rank in (0, 1):
        assert categories(measured[rank][strategy]) == categories(expected[rank]), rank


def test_fsdp_pads_parameters_but_not_optimizer_state(measured):
    needs_fsdp(measured)
    # 5 and 3 rows over 2 ranks: rank 1 holds 2 and 1 rows in storages padded to 3 and 2.
    rank1 = measured[1]["fsdp"]
    assert rank1.parameters == (3 * 6 + 3 + 2 * 5 + 2) * 4
    assert rank1.optimizer_state == (2 * 6 + 2 + 1 * 5 + 1) * 4 * 2 + 4 * 4
    assert measured[0]["fsdp"].parameters == rank1.parameters


def test_zero_partition_is_torchs(measured):
    sizes = [p.numel() for p in odd_model().parameters()]  # 30, 5, 15, 3
    assert memplan.zero_partition(sizes, 2) == [[0], [2, 1, 3]]
    for rank in (0, 1):
        assert measured[rank]["zero_owned"] == sorted(memplan.zero_partition(sizes, 2)[rank])


def test_ddp_buckets_counted_once(measured):
    grads = 53 * 4
    copied, view = measured[0]["ddp"], measured[0]["ddp_view"]
    assert (copied.gradients, copied.communication) == (grads, grads)
    assert (view.gradients, view.communication) == (grads, 0)
    as_view = memplan.estimate(odd_model(), world_size=2, gradient_as_bucket_view=True)
    assert categories(view) == categories(as_view[0])
    # The logging data's bucket sizes agree with the reducer's own bucket tensors.
    assert measured[0]["ddp_zeros_like_buckets"] == grads
    assert measured[0]["ddp_view_zeros_like_buckets"] == grads


def test_tracked_breakdown_travels_back_and_stays_until_cleared(measured):
    b = measured[1]["zero1"]
    assert isinstance(b, memplan.MemoryBreakdown) and b.device == "cpu"
    # Tracked after training: no forward ran under the hooks, so autograd saved nothing seen.
    assert b.activations == 0 and b.rest_of_peak is None
    assert b.peak and "rest of the peak: SKIPPED" in " ".join(b.notes)
    again = measured[1]["tracked_again"]
    # The same tensors; only the process's peak RSS, read again later, may have grown.
    assert dataclasses.replace(again, peak=b.peak) == b and again.peak >= b.peak
    assert pickle.loads(pickle.dumps(b)) == b
    assert b.total == sum(categories(b).values()) == b.as_dict()["total"]


def test_clear_tracked_forgets():
    model = odd_model()
    breakdown_module.track(model)
    breakdown_module.clear_tracked()
    assert breakdown_module.tracked_breakdown() is None
    breakdown_module.track(model)
    assert breakdown_module.tracked_breakdown().parameters == 53 * 4


@pytest.mark.parametrize("name", sorted(memplan.OPTIMIZER_STATE_PER_ELEMENT))
def test_optimizer_state_per_optimizer(name):
    model = odd_model()
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop,
    }[name]
    opt = make(model.parameters())
    train(model, opt)
    got = breakdown_module.breakdown(model, opt)
    want = memplan.estimate(model, optimizer=name)[0]
    assert categories(got) == {**categories(want), "communication": 0}


def test_shared_storages_count_once():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("flat", torch.zeros(8))
    model.register_buffer("first_half", model.flat[:4])
    assert breakdown_module.breakdown(model).parameters == 16 * 4 + 8 * 4


def test_estimate_from_a_count():
    n = 1_000_001
    ddp = memplan.estimate(n, world_size=4)
    assert {b.optimizer_state for b in ddp} == {2 * n * 4}
    zero = memplan.estimate(n, world_size=4, strategy="zero1")
    assert sum(b.optimizer_state for b in zero) == 2 * n * 4
    fsdp = memplan.estimate(n, dtype=torch.bfloat16, world_size=4, strategy="fsdp")
    assert fsdp[0].parameters == 250_001 * 2 and fsdp[0].transient == 2 * 250_001 * 4 * 2
    with pytest.raises(ValueError, match="strategy must be one of"):
        memplan.estimate(n, strategy="zero3")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        memplan.estimate(n, optimizer="lamb")


def test_plot_breakdown_stacks_one_bar_per_rank():
    per_rank = memplan.estimate(odd_model(), world_size=2, strategy="fsdp")
    fig = plots.plot_breakdown(
        {"DDP": memplan.estimate(odd_model(), world_size=2), "FSDP": per_rank}
    )
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["DDP\nrank 0", "DDP\nrank 1", "FSDP\nrank 0", "FSDP\nrank 1"]
    outer = plt.figure()
    plt.close(outer)
    assert plots.plot_breakdown(per_rank, ax=outer.add_subplot(1, 2, 2)) is outer
    with pytest.raises(ValueError, match="no breakdowns"):
        plots.plot_breakdown([])


def test_plot_breakdown_labels_stay_below_the_title():
    from mgtutor.models import small_cnn

    fig = plots.plot_breakdown(
        {
            "DDP": memplan.estimate(small_cnn(), world_size=2),
            "FSDP": memplan.estimate(small_cnn(), world_size=2, strategy="fsdp"),
        },
        title="The calculator, FSDP's all-gathered unit included",
    )
    fig.draw_without_rendering()
    ax = fig.axes[0]
    title_bottom = ax.title.get_window_extent().y0
    axes_top = ax.get_window_extent().y1
    for label in ax.texts:
        box = label.get_window_extent()
        assert box.y1 <= axes_top and box.y1 < title_bottom, (label.get_text(), box, axes_top)
    plt.close(fig)


def test_track_puts_the_breakdown_in_the_run_and_its_memory_plot() -> None:
    def tracked():
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        mgtutor.setup()
        ddp = DDP(torch.nn.Linear(4, 3))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        mgtutor.track(ddp, opt)
        ddp(torch.randn(2, 4)).sum().backward()
        opt.step()

    run = mgtutor.launch(tracked, world_size=2)
    # 15 float32 values: the momentum buffers, and DDP's one bucket of gradients.
    assert [r.breakdown.optimizer_state for r in run.ranks] == [15 * 4, 15 * 4]
    assert [r.breakdown.communication for r in run.ranks] == [15 * 4, 15 * 4]
    # What autograd saved in the tracked forward: the linear layer's input, 2 x 4 float32.
    assert [r.breakdown.activations for r in run.ranks] == [2 * 4 * 4, 2 * 4 * 4]
    assert len(mgtutor.plot_memory(run).axes) == 2
    untracked = mgtutor.launch(lambda: None, world_size=1)
    assert untracked.ranks[0].breakdown is None and len(mgtutor.plot_memory(untracked).axes) == 1
