"""Activations as what autograd saves, and the rest of a GPU's peak as its own category."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from torch import nn

matplotlib.use("Agg")

import mgtutor  # noqa: E402
from mgtutor.measure import breakdown as breakdown_module  # noqa: E402
from mgtutor.measure.activations import LiveTensors, SavedActivations  # noqa: E402

BATCH, WIDTH = 32, 128
F32 = 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )


# What autograd saves for this MLP, parameters aside: the batch (the first linear layer's
# input) and the two ReLU outputs (each ReLU's result, and the next linear layer's input).
BATCH_BYTES = BATCH * 64 * F32
RELU_BYTES = BATCH * WIDTH * F32
SAVED = BATCH_BYTES + 2 * RELU_BYTES


def test_saved_activations_counts_what_autograd_keeps_and_only_while_it_keeps_it() -> None:
    model, x = mlp(), torch.randn(BATCH, 64)
    model(x).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    watch = SavedActivations(model)
    with LiveTensors() as live:
        out = model(x)
        created = live.live_bytes()
    assert watch.peak == SAVED
    # LiveTensors counts what operators created and is alive: the two ReLU outputs and the
    # output (not the batch, made before the block). The difference is exactly those two.
    assert created == 2 * RELU_BYTES + out.nbytes
    assert watch.peak == created - out.nbytes + BATCH_BYTES
    out.sum().backward()
    assert watch.live_bytes() == 0, "backward freed them; x, still held here, is not autograd's"
    assert all(torch.equal(g, p.grad) for g, p in zip(expected_grads, model.parameters()))
    first, second = model(x), model(x)  # two graphs alive: both count, the batch once
    assert watch.live_bytes() == watch.peak == BATCH_BYTES + 4 * RELU_BYTES
    del first, second
    watch.reset_peak()
    watch.remove()
    model(x).sum().backward()
    assert watch.peak == 0, "removed hooks see nothing"


def test_tracked_breakdown_measures_activations_on_cpu_and_resets() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgtutor.track(model, opt)
    try:
        model(torch.randn(BATCH, 64)).sum().backward()
        opt.step()
        b = breakdown_module.tracked_breakdown()
        assert b.device == "cpu" and b.activations == SAVED and b.rest_of_peak is None
        assert "rest of the peak: SKIPPED on CPU" in " ".join(b.notes)
        breakdown_module.reset_tracked_peak()  # what a rank does when the next call starts
        assert breakdown_module.tracked_breakdown().activations == 0
    finally:
        breakdown_module.clear_tracked()
    model(torch.randn(BATCH, 64))
    assert breakdown_module.tracked_breakdown() is None
    # Without track, nothing watched the forward: unknown, not zero.
    assert breakdown_module.breakdown(model, opt).activations is None


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch):
    """breakdown() as on a CUDA rank whose allocator peaked at 64 MiB (no GPU needed)."""
    peak = 64 * 2**20
    monkeypatch.setattr(breakdown_module, "_device_of", lambda params: "cuda:0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    return peak


def test_on_a_gpu_the_categories_add_up_to_the_peak_each_what_its_name_says(on_a_gpu) -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(BATCH, 64)).sum().backward()
    opt.step()
    params = sum(p.nbytes for p in model.parameters())
    b = breakdown_module.breakdown(model, opt, activations=SAVED)
    assert b.activations == SAVED, "activations are what autograd saved, not the peak's rest"
    held = b.parameters + b.gradients + b.optimizer_state + SAVED
    assert b.parameters == b.gradients == params
    assert b.rest_of_peak == on_a_gpu - held > 60 * 2**20  # the workspaces, in their own bar
    assert b.total == b.peak == on_a_gpu
    ax = mgtutor.plot_breakdown([b]).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[-2:] == ["activations", "rest of the peak (workspaces, temporaries)"]
    heights = {c.get_label(): c.patches[0].get_height() for c in ax.containers}
    assert heights["activations"] == pytest.approx(SAVED / 2**20)
    # Unmeasured activations stay unknown; the rest then holds them, and says so by its name.
    untracked = breakdown_module.breakdown(model, opt)
    assert untracked.activations is None and untracked.total == on_a_gpu


def test_categories_that_exceed_the_peak_say_so(on_a_gpu) -> None:
    model = mlp()
    b = breakdown_module.breakdown(
        model, activations=on_a_gpu
    )  # more than fits beside the parameters
    assert b.rest_of_peak == 0
    assert any("exceed the peak" in note for note in b.notes)


def _track_and_train() -> None:
    model = nn.Linear(4, 3)
    mgtutor.track(model)
    model(torch.randn(2, 4)).sum().backward()


def _nothing() -> None:
    pass


def test_a_pools_later_call_does_not_report_an_earlier_calls_activations() -> None:
    with mgtutor.Pool(world_size=1) as pool:
        first = pool.run(_track_and_train).ranks[0].breakdown
        later = pool.run(_nothing).ranks[0].breakdown  # still tracked, no forward this time
    assert first.activations == 2 * 4 * 4
    assert later is not None and later.activations == 0


def _tensor_parallel_activations() -> tuple[int, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mgtutor.setup()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(
        model, init_device_mesh("cpu", (2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    watch = SavedActivations(model)
    model(torch.randn(4, 8)).sum().backward()  # DTensors saved: no storage of their own
    return watch.peak, all(p.grad is not None for p in model.parameters())


def test_saved_activations_count_a_dtensors_local_shard_and_training_goes_on() -> None:
    results = mgtutor.launch(_tensor_parallel_activations, world_size=2).results
    # Per rank: the batch, 4 x 8 float32, and this rank's half of the ReLU output, 4 x 8.
    assert results == [(4 * 8 * F32 + 4 * 8 * F32, True)] * 2
