"""mgtutor.parallel.syncbn: SyncBatchNorm on CPU/gloo equals one BatchNorm over the whole batch.

The distributed tests launch 2 ranks. Every rank receives the full 8-sample batch as an
argument and keeps its own slice (3 + 5, 4 + 4 or 0 + 8 samples); the test process compares
what the ranks return with a single torch BatchNorm run over all 8 samples. A launch costs
seconds, so one launch (``_launch_training``, cached) runs every split and every check but the
eval-mode one, and the tests below each read their part of its results.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import mgtutor
from mgtutor.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm

SPLITS = [(3, 5), (4, 4), (0, 8)]
STEPS = 2  # two training steps, so the running statistics are updated twice
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
REFERENCE = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
# torch's BatchNorm layers take `bias=` from torch 2.12 on; older ones (the floor in
# requirements.txt) have no such argument. mgtutor's SyncBatchNorm takes it on every version.
TORCH_BATCHNORM_TAKES_BIAS = "bias" in inspect.signature(nn.BatchNorm1d).parameters


def _make_case(shape: tuple[int, ...], seed: int, **options: Any) -> dict[str, Any]:
    """Inputs, upstream gradients and a starting state for one BatchNorm configuration."""
    gen = torch.Generator().manual_seed(seed)
    layer = REFERENCE[len(shape)](shape[1], dtype=torch.float64, **options)
    with torch.no_grad():
        # Not the defaults (ones and zeros), so a mistake in how they are used shows.
        if layer.affine:
            layer.weight.uniform_(0.5, 1.5, generator=gen)
            layer.bias.uniform_(-1, 1, generator=gen)
        if layer.track_running_stats:
            layer.running_mean.uniform_(-1, 1, generator=gen)
            layer.running_var.uniform_(0.5, 2, generator=gen)
            layer.num_batches_tracked.fill_(3)
    return {
        "options": options,
        "state": layer.state_dict(),
        # A mean far from zero and a spread other than one, as real activations have.
        "x": 3 + 2 * torch.randn(STEPS, *shape, generator=gen, dtype=torch.float64),
        "grad": torch.randn(STEPS, *shape, generator=gen, dtype=torch.float64),
    }


CASES = {
    "NCHW": _make_case((8, 3, 4, 5), seed=1),
    "NC": _make_case((8, 3), seed=2),
    "NCL, momentum=None": _make_case((8, 3, 6), seed=3, momentum=None),
    "NCDHW, affine=False": _make_case((8, 2, 3, 2, 2), seed=4, affine=False),
    "NCHW, track_running_stats=False": _make_case((8, 2, 3, 3), seed=5, track_running_stats=False),
}


# Inputs whose mean is large against their spread, in the dtypes models train in. The variance
# must survive: forming x² in float32 (the bug this guards against) gave a relative error of
# 1e-1 for the float32 case, torch's own float32 BatchNorm 2.4e-7.
LOW_PRECISION = {
    "float32, mean 1e4": (torch.float32, 1e4),
    "bfloat16, mean 1e2": (torch.bfloat16, 1e2),
}
LOW_PRECISION_SPLIT = (3, 5)


def _low_precision_case(dtype: torch.dtype, mean: float) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "x": (mean + torch.randn(8, 4, 16, 16, generator=gen, dtype=torch.float64)).to(dtype),
        "grad": torch.randn(8, 4, 16, 16, generator=gen, dtype=torch.float64).to(dtype),
    }


def _low_precision_step(layer: nn.Module, x: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """One training step; float32 parameters and buffers, whatever the input's dtype."""
    x = x.clone().requires_grad_()
    y = layer(x)
    (y.double() * grad.double()).sum().backward()
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "weight_grad": layer.weight.grad,
        "bias_grad": layer.bias.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
    }


def _make_layer(case: dict[str, Any], sync: bool) -> nn.Module:
    shape = case["x"].shape[1:]
    layer_class = SyncBatchNorm if sync else REFERENCE[len(shape)]
    layer = layer_class(shape[1], dtype=torch.float64, **case["options"])
    layer.load_state_dict(case["state"])
    return layer


def _train_steps(layer: nn.Module, case: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Run STEPS training steps on samples lo:hi; return what each step produced."""
    steps = []
    for x_all, grad_all in zip(case["x"], case["grad"]):
        x = x_all[lo:hi].clone().requires_grad_()
        y = layer(x)
        # The loss whose gradient with respect to y is grad_all[lo:hi]; the ranks' losses add
        # up to the single process's loss.
        (y * grad_all[lo:hi]).sum().backward()
        steps.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "weight_grad": None if layer.weight is None else layer.weight.grad.clone(),
                "bias_grad": None if layer.bias is None else layer.bias.grad.clone(),
            }
        )
        layer.zero_grad(set_to_none=True)
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    return {"steps": steps, "buffers": buffers}


def _count_all_reduces(channels: int, x: Tensor) -> dict[str, int]:
    """How many times dist.all_reduce runs for a model with two SyncBatchNorm layers."""
    model = nn.Sequential(
        SyncBatchNorm(channels), nn.Conv2d(channels, channels, 1), SyncBatchNorm(channels)
    ).double()
    counts: dict[str, int] = {}
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        y = model(x.clone().requires_grad_())
        counts["forward"] = all_reduce.call_count
        y.sum().backward()
        counts["backward"] = all_reduce.call_count - counts["forward"]

        all_reduce.reset_mock()
        y = model(x)  # the first layer's input needs no gradient this time
        forward_calls = all_reduce.call_count
        y.sum().backward()
        counts["backward, input from data"] = all_reduce.call_count - forward_calls

        all_reduce.reset_mock()
        model.eval()
        with torch.no_grad():
            model(x)
        counts["eval"] = all_reduce.call_count
    return counts


def _mean_loss_gradients(model: nn.Module, x: Tensor) -> list[Tensor]:
    model(x).square().mean().backward()
    return [p.grad for p in model.parameters()]


def _train_worker(
    cases: dict[str, dict[str, Any]], splits: list[tuple[int, int]], ddp_model: nn.Module
) -> dict[Any, Any]:
    """One rank's side of every distributed check but eval mode (each launch costs seconds)."""
    mgtutor.setup()
    rank = dist.get_rank()
    result: dict[Any, Any] = {}
    for split in splits:
        lo = sum(split[:rank])
        hi = lo + split[rank]
        result[split] = {
            name: _train_steps(_make_layer(case, sync=True), case, lo, hi)
            for name, case in cases.items()
        }
        result[split]["all_reduce counts"] = _count_all_reduces(3, cases["NCHW"]["x"][0][lo:hi])

    lo = sum(LOW_PRECISION_SPLIT[:rank])
    hi = lo + LOW_PRECISION_SPLIT[rank]
    for name, (dtype, mean) in LOW_PRECISION.items():
        case = _low_precision_case(dtype, mean)
        layer = SyncBatchNorm(4, momentum=1.0)  # running statistics: this batch's exactly
        result[name] = _low_precision_step(layer, case["x"][lo:hi], case["grad"][lo:hi])

    # One value per channel in the whole batch: rank 0 holds one sample, the others none.
    try:
        SyncBatchNorm(3)(cases["NC"]["x"][0][: 1 if rank == 0 else 0])
        result["one value error"] = None
    except ValueError as exc:
        result["one value error"] = str(exc)

    # DDP averages the ranks' gradients; with equal batches (4 + 4) and a mean loss, that is
    # the gradient of the single process's mean loss.
    model = DistributedDataParallel(convert_sync_batchnorm(ddp_model))
    result["ddp grads"] = _mean_loss_gradients(
        model, cases["NCHW"]["x"][0][4 * rank : 4 * rank + 4]
    )
    return result


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2)
    ).double()


@functools.cache
def _launch_training() -> list[dict[Any, Any]]:
    return mgtutor.launch(
        _train_worker, CASES, SPLITS, _small_cnn(), world_size=2, timeout=90
    ).results


@functools.cache
def _single_batchnorm(case_name: str) -> dict[str, Any]:
    case = CASES[case_name]
    return _train_steps(_make_layer(case, sync=False), case, 0, 8)


def _assert_close(actual: Tensor, expected: Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCE)


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_outputs_and_gradients_equal_one_batchnorm_over_all_samples(
    splits: tuple[int, int], case_name: str
) -> None:
    ranks = [r[splits][case_name] for r in _launch_training()]
    expected = _single_batchnorm(case_name)
    for step, want in enumerate(expected["steps"]):
        got = [r["steps"][step] for r in ranks]
        _assert_close(torch.cat([g["y"] for g in got]), want["y"])
        _assert_close(torch.cat([g["x_grad"] for g in got]), want["x_grad"])
        for name in ("weight_grad", "bias_grad"):
            if want[name] is None:
                assert all(g[name] is None for g in got)
            else:
                # Each rank's parameter gradient covers its own samples; DDP combines them.
                _assert_close(sum(g[name] for g in got), want[name])


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_running_statistics_equal_one_batchnorm_and_agree_across_ranks(
    splits: tuple[int, int], case_name: str
) -> None:
    ranks = [r[splits][case_name]["buffers"] for r in _launch_training()]
    expected = _single_batchnorm(case_name)["buffers"]
    assert ranks[0].keys() == ranks[1].keys() == expected.keys()
    for name, want in expected.items():
        # Bit for bit equal across ranks: all update from the same all-reduced sums.
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        if name == "num_batches_tracked":
            assert ranks[0][name].item() == want.item() == 3 + STEPS
        else:
            _assert_close(ranks[0][name], want)


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "+".join(map(str, s)))
def test_one_all_reduce_per_layer_in_forward_and_one_in_backward(splits: tuple[int, int]) -> None:
    for counts in (r[splits]["all_reduce counts"] for r in _launch_training()):
        assert counts == {
            "forward": 2,
            "backward": 2,
            # Torch's SyncBatchNorm also skips it when no gradient flows into the input.
            "backward, input from data": 1,
            "eval": 0,
        }


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_inputs_with_a_large_mean_keep_their_variance(name: str) -> None:
    dtype, mean = LOW_PRECISION[name]
    case = _low_precision_case(dtype, mean)
    # The exact answer: one BatchNorm over all 8 samples, in float64, on the same values.
    reference = nn.BatchNorm2d(4, momentum=1.0, dtype=torch.float64)
    want = _low_precision_step(reference, case["x"].double(), case["grad"])
    ranks = [r[name] for r in _launch_training()]
    for key in ("running_mean", "running_var"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    error = ((ranks[0]["running_var"].double() - want["running_var"]) / want["running_var"]).abs()
    # float32 buffers: rounding them alone is 6e-8; the old x² sums were off by 1e-1.
    assert error.max() < 1e-6, f"running_var relative error {error.max():.1e}"
    torch.testing.assert_close(ranks[0]["running_mean"].double(), want["running_mean"])
    y = torch.cat([r["y"] for r in ranks])
    x_grad = torch.cat([r["x_grad"] for r in ranks])
    assert y.dtype == x_grad.dtype == dtype
    # Outputs and input gradients come back in the input's dtype: within its rounding.
    # (bfloat16: assert_close's own tolerance for it, 2^-6 relative.)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, want["y"].to(dtype), **tolerance)
    torch.testing.assert_close(x_grad, want["x_grad"].to(dtype), **tolerance)
    for key in ("weight_grad", "bias_grad"):
        got = sum(r[key].double() for r in ranks)
        torch.testing.assert_close(got, want[key], rtol=1e-5, atol=1e-3)


def test_one_value_per_channel_across_all_ranks_is_an_error_on_every_rank() -> None:
    errors = [r["one value error"] for r in _launch_training()]
    assert all(e is not None and "more than 1 value per channel" in e for e in errors), errors
    assert "got 1 in total across the 2 ranks" in errors[1]


def test_ddp_with_equal_batches_and_a_mean_loss_gives_single_process_gradients() -> None:
    ddp_grads = [r["ddp grads"] for r in _launch_training()]
    expected = _mean_loss_gradients(_small_cnn(), CASES["NCHW"]["x"][0])
    for rank_grads in ddp_grads:
        assert len(rank_grads) == len(expected)
        for got, want in zip(rank_grads, expected):
            _assert_close(got, want)


def _evaluate_on_rank_zero_only(layer: nn.Module, x: Tensor) -> Tensor | None:
    mgtutor.setup()
    if dist.get_rank() != 0:
        return None  # gone at once: a collective on rank 0 would now fail or hang
    layer.eval()
    with torch.no_grad():
        return layer(x)


def test_eval_mode_uses_running_statistics_and_needs_no_other_rank() -> None:
    case = CASES["NCHW"]
    sync_layer = _make_layer(case, sync=True)
    run = mgtutor.launch(_evaluate_on_rank_zero_only, sync_layer, case["x"][0], timeout=30)
    expected = _make_layer(case, sync=False).eval()(case["x"][0])
    _assert_close(run.results[0], expected.detach())
    assert run.results[1] is None


def test_without_a_process_group_it_is_exactly_batchnorm() -> None:
    assert not dist.is_initialized()
    case = CASES["NCHW"]
    got = _train_steps(_make_layer(case, sync=True), case, 0, 8)
    want = _train_steps(_make_layer(case, sync=False), case, 0, 8)
    for got_step, want_step in zip(got["steps"], want["steps"]):
        for name, value in want_step.items():
            assert torch.equal(got_step[name], value), name
    for name, value in want["buffers"].items():
        assert torch.equal(got["buffers"][name], value), name


def test_constructor_matches_torch_syncbatchnorm() -> None:
    for options in ({}, {"momentum": None, "eps": 1e-3}, {"affine": False}):
        ours = SyncBatchNorm(4, **options)
        theirs = nn.SyncBatchNorm(4, **options)
        assert ours.extra_repr() == theirs.extra_repr()
        assert ours.state_dict().keys() == theirs.state_dict().keys()
    without_bias = SyncBatchNorm(4, bias=False)
    assert without_bias.bias is None and "weight" in without_bias.state_dict()
    assert "bias" not in without_bias.state_dict()
    with pytest.raises(ValueError, match=r"shape \(N, C, \*\).*got shape \(4,\)"):
        SyncBatchNorm(4)(torch.zeros(4))


@pytest.mark.skipif(
    not TORCH_BATCHNORM_TAKES_BIAS,
    reason=f"torch's SyncBatchNorm takes bias= from torch 2.12; this is torch {torch.__version__}",
)
def test_constructor_without_bias_matches_torch_syncbatchnorm() -> None:
    ours, theirs = SyncBatchNorm(4, bias=False), nn.SyncBatchNorm(4, bias=False)
    assert ours.extra_repr() == theirs.extra_repr()
    assert ours.state_dict().keys() == theirs.state_dict().keys()


def _model_with_batchnorms() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4, momentum=None, eps=1e-3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
        nn.Sequential(nn.BatchNorm1d(5, affine=False)),
    )
    bn = model[1]
    with torch.no_grad():
        bn.weight.uniform_()
        bn.bias.uniform_()
        bn.running_mean.uniform_()
        bn.running_var.uniform_(1, 2)
        bn.num_batches_tracked.fill_(7)
    bn.bias.requires_grad_(False)
    bn.qconfig = "a quantization config"
    model[5].eval()
    return model


def test_convert_sync_batchnorm_replaces_batchnorm_layers_and_keeps_their_state() -> None:
    model = _model_with_batchnorms()
    others = [model[0], model[2], model[3], model[4]]
    before = copy.deepcopy(model.state_dict())

    converted = convert_sync_batchnorm(model)

    assert converted is model  # converted in place, as torch does
    assert [m for i, m in enumerate(converted) if i != 1 and i != 5] == others
    bn, inner = converted[1], converted[5][0]
    assert type(bn) is SyncBatchNorm and type(inner) is SyncBatchNorm
    assert (bn.momentum, bn.eps, bn.affine) == (None, 1e-3, True)
    assert inner.affine is False and inner.weight is None
    assert bn.weight.requires_grad and not bn.bias.requires_grad
    assert bn.training and not inner.training
    assert bn.qconfig == "a quantization config"
    after = converted.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name

    bare = nn.BatchNorm1d(3, track_running_stats=False)
    bare.bias = None  # what bias=False does; torch before 2.12 has no such argument
    new = convert_sync_batchnorm(bare)
    assert type(new) is SyncBatchNorm and new.bias is None and new.running_mean is None
    # A CPU model that torch's own conversion already went through gets layers that work here.
    assert type(convert_sync_batchnorm(nn.SyncBatchNorm(3))) is SyncBatchNorm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_convert_sync_batchnorm_on_cuda_uses_torch_syncbatchnorm() -> None:
    converted = convert_sync_batchnorm(_model_with_batchnorms().cuda())
    assert type(converted[1]) is nn.SyncBatchNorm and type(converted[5][0]) is nn.SyncBatchNorm
    # Converted before the move: mgtutor's class, which hands CUDA inputs to torch's kernels
    # (checked on 2 GPUs in tests/test_gpu.py). Its tensors follow the model to the GPU.
    moved = convert_sync_batchnorm(_model_with_batchnorms()).cuda()
    assert type(moved[1]) is SyncBatchNorm and moved[1].running_mean.is_cuda
