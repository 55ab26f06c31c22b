"""LiveTensors: what it counts as alive, and that its count fails when the claim is false."""

import torch
from torch.utils.checkpoint import checkpoint

from mgtutor.measure.activations import LiveTensors


def _stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU()
    )


def test_counts_what_forward_keeps_and_frees_after_backward():
    net, x = _stack(), torch.randn(64, 8)
    with LiveTensors() as live:
        out = net(x)
        loss = out.sum()
        del out
        kept = live.live_bytes()
        live.reset_peak()
        loss.backward()
        del loss
        after = live.live_bytes()
    # ReLU keeps its outputs (two of 64 x 8 float32); the first linear's output is freed by
    # the ReLU after it; the input x was made before the block and is not counted.
    assert kept == 2 * x.nbytes + 4
    assert live.peak >= kept
    assert after == sum(p.numel() * 4 for p in net.parameters())  # only the gradients remain
    assert live.op_counts["aten.addmm.default"] == 2


def test_checkpoint_keeps_less_and_recomputes():
    net, x = _stack(), torch.randn(64, 8)
    with LiveTensors() as plain:
        y = net(x)
        plain_kept = plain.live_bytes()
    with LiveTensors() as checkpointed:
        y = checkpoint(net, x, use_reentrant=False)
        checkpointed_kept = checkpointed.live_bytes()
        y.sum().backward()
    assert checkpointed_kept == y.nbytes < plain_kept
    assert checkpointed.op_counts["aten.addmm.default"] == 4  # forward, then the recompute


def test_ignores_views_inplace_and_tensors_made_before():
    before = torch.ones(1000)
    with LiveTensors() as live:
        before.add_(1)
        view = before[:10]
        new = before * 2
        assert live.live_bytes() == new.nbytes
        del new, view
        assert live.live_bytes() == 0


def test_sees_a_storage_resized_after_it_was_made():
    with LiveTensors() as live:
        t = torch.empty(100)
        t.untyped_storage().resize_(0)
        assert live.live_bytes() == 0
        t.untyped_storage().resize_(40)
        assert live.live_bytes() == 40


def test_garbage_in_a_cycle_does_not_count_and_the_collector_comes_back():
    import gc

    assert gc.isenabled()
    with LiveTensors() as live:
        assert not gc.isenabled()  # a collection cannot run at a random moment inside
        cycle = {"tensor": torch.ones(100) * 2}
        cycle["self"] = cycle
        del cycle
        assert live.live_bytes() == 0
    assert gc.isenabled()


def test_a_tensor_another_thread_is_letting_go_of_does_not_count(monkeypatch):
    # As gloo's worker thread holds a finished collective's tensor for a moment: the reading
    # is taken again after the GIL was released, here the moment the holder lets go.
    import threading
    import types

    from mgtutor.measure import activations

    held, release = [], threading.Event()

    def holder():
        release.wait()
        held.clear()

    thread = threading.Thread(target=holder)
    thread.start()

    def sleep(seconds):
        release.set()
        thread.join()

    with LiveTensors() as live:
        held.append(torch.ones(1000))
        kept = torch.ones(10)
        monkeypatch.setattr(activations, "time", types.SimpleNamespace(sleep=sleep))
        assert live.live_bytes() == kept.nbytes
