"""mgtutor.models, .metrics and .stats: the shared models, cross-rank means and spreads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mgtutor
from mgtutor.measure.stats import compare, spread
from mgtutor.models import mlp, small_cnn


def test_small_cnn_shapes_and_size() -> None:
    model = small_cnn()
    out = model(torch.zeros(4, 3, 16, 16))
    assert out.shape == (4, 10)
    # conv 3->16 (3x3) + conv 16->32 (3x3) + linear 32->10, weights and biases.
    expected = (3 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 10 + 10)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_small_cnn_batchnorm_and_options() -> None:
    model = small_cnn(num_classes=4, channels=1, batchnorm=True)
    kinds = [type(m).__name__ for m in model]
    assert kinds.count("BatchNorm2d") == 2
    assert kinds.index("BatchNorm2d") == kinds.index("Conv2d") + 1  # conv, BN, ReLU
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    with pytest.raises(ValueError, match="num_classes"):
        small_cnn(num_classes=0)


def test_small_cnn_same_seed_same_weights() -> None:
    torch.manual_seed(3)
    a = small_cnn()
    torch.manual_seed(3)
    b = small_cnn()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _uneven_means() -> dict[str, float]:
    mgtutor.setup("gloo")
    rank = dist.get_rank()
    # rank 0 saw 10 samples summing to 30, rank 1 saw 30 summing to 10: exact mean 40 / 40.
    total, count = (30.0, 10) if rank == 0 else (10.0, 30)
    return {
        "exact": mgtutor.reduce_mean(total, count),
        "mean_of_means": mgtutor.reduce_mean(torch.tensor(total / count)),
        "sums": mgtutor.reduce_sums(total, count),
    }


def test_reduce_mean_is_sum_over_count_on_every_rank() -> None:
    run = mgtutor.launch(_uneven_means, world_size=2, timeout=60)
    for result in run.results:
        assert result["exact"] == pytest.approx(1.0)
        assert result["mean_of_means"] == pytest.approx((3.0 + 1 / 3) / 2)
        assert result["sums"] == [40.0, 40.0]


def _bad_calls() -> list[str]:
    mgtutor.setup("gloo")
    messages = []
    for call in (
        lambda: mgtutor.reduce_sums(),
        lambda: mgtutor.reduce_sums(torch.ones(3)),
        lambda: mgtutor.reduce_mean(1.0, 0),
    ):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_reduce_helpers_refuse_bad_input() -> None:
    (messages, _) = mgtutor.launch(_bad_calls, world_size=2, timeout=60).results
    assert len(messages) == 3
    assert "at least one value" in messages[0]
    assert "3 elements" in messages[1]
    assert "add up to 0" in messages[2]


def test_reduce_sums_outside_a_process_group_says_what_to_do() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is open in the test process")
    with pytest.raises(RuntimeError, match=r"mgtutor.setup\(\)"):
        mgtutor.reduce_sums(1.0)


def test_mlp_layers_and_size() -> None:
    model = mlp(width=8, depth=3)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert sum(p.numel() for p in model.parameters()) == 3 * (8 * 8 + 8)
    assert model(torch.zeros(2, 8)).shape == (2, 8)
    with pytest.raises(ValueError, match="depth"):
        mlp(depth=0)


def test_spread_and_compare() -> None:
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert compare([1, 2], [3, 4]) == "lower"
    assert compare([3, 4], [1, 2]) == "higher"
    assert compare([1, 3], [2, 4]) is None  # overlapping ranges: no difference claimed
    assert compare([1, 2], [2, 3]) is None  # touching is overlapping
    with pytest.raises(ValueError, match="at least one"):
        spread([])
    with pytest.raises(ValueError, match="each side"):
        compare([], [1])
