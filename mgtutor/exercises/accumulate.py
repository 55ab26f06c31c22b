"""Notebook 05's exercise: gradient accumulation under DDP, one all-reduce per optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    everyone_ok,
    make_finding,
    same_tensors,
)

__all__ = ["CASES", "EXERCISE", "check_accumulation", "run"]

CASES = (  # label, micro-batches per rank, K
    ("8 micro-batches, K=4: 2 optimizer steps", 8, 4),
    ("5 micro-batches, K=2: windows of 2, 2 and 1", 5, 2),
    ("3 micro-batches, K=1: a step after each", 3, 1),
)
_MICRO_BATCH, _FEATURES = 3, 5


def check_accumulation(accumulate: Callable[..., Any], *, timeout: float = 20.0) -> CheckResult:
    """Check gradient accumulation under DDP: the big batch's gradients, one all-reduce a step.

    The exercise: write ``accumulate(model, optimizer, micro_batches, k) -> None``. ``model``
    is DDP-wrapped, ``micro_batches`` a list of this rank's ``(x, y)`` pairs (all of one size),
    the loss ``F.mse_loss(model(x), y)``. Train through the list in windows of ``k``
    micro-batches (the last window may hold fewer) with one ``optimizer.step()`` and
    ``optimizer.zero_grad()`` per window, so that each step uses the gradient of the window's
    samples from all ranks as one batch, and so that DDP all-reduces once per step.

    The checker runs it on 2 ranks, compares the gradients at every step with one process on
    the global batch, and counts the all-reduces with a DDP communication hook.

    Args:
        accumulate: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``accumulate`` is not a function.
    """
    return check(EXERCISE, (accumulate,), timeout)


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it was asked to step with."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.recorded: list[list[torch.Tensor | None]] = []

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        self.recorded.append([None if p.grad is None else p.grad.clone() for p in params])
        return super().step(closure)


def _sync_counter(model: DDP) -> dict[str, int]:
    counts = {"syncs": 0}

    # DDP checks a hook's signature: the second parameter must be named bucket, no annotations.
    def hook(state, bucket):
        counts["syncs"] += bucket.is_last()  # one per backward that all-reduced
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(state=None, hook=hook)
    return counts


def _accumulation_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(_FEATURES, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _one_process(xs: torch.Tensor, ys: torch.Tensor, k: int) -> tuple[list, list]:
    """Each window's gradients and the final weights of one process on the global batches."""
    model = _accumulation_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for start in range(0, xs.shape[1], k):
        x = xs[:, start : start + k].reshape(-1, _FEATURES)
        F.mse_loss(model(x), ys[:, start : start + k].reshape(-1, 1)).backward()
        step_grads = []
        for p in model.parameters():
            assert p.grad is not None  # every parameter of this model is in the loss
            step_grads.append(p.grad.clone())
        grads.append(step_grads)
        optimizer.step()
        optimizer.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, m, k) in enumerate(CASES):
        generator = torch.Generator().manual_seed(number)
        shape = (world, m, _MICRO_BATCH)
        xs = torch.randn(*shape, _FEATURES, dtype=torch.float64, generator=generator)
        ys = torch.randn(*shape, 1, dtype=torch.float64, generator=generator)
        reference_grads, reference_weights = _one_process(xs, ys, k)
        model = DDP(_accumulation_model())
        counts = _sync_counter(model)
        optimizer = _RecordingSGD(model.parameters(), lr=0.1)
        micro_batches = [(xs[rank, j], ys[rank, j]) for j in range(m)]
        call_learner(index, case, fn, model, optimizer, micro_batches, k)
        weights = [p.detach().clone() for p in model.parameters()]
        findings.append(
            _diagnose_accumulation(
                case,
                m,
                k,
                optimizer.recorded,
                counts["syncs"],
                weights,
                reference_grads,
                reference_weights,
            )
        )
        if not everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_accumulation(
    case: str,
    m: int,
    k: int,
    recorded: list,
    syncs: int,
    weights: list,
    reference_grads: list,
    reference_weights: list,
) -> Finding:
    sizes = [min(k, m - start) for start in range(0, m, k)]
    windows = len(sizes)
    if len(recorded) != windows:
        detail = (
            f"optimizer.step() ran {len(recorded)} time(s) for {m} micro-batches with K={k}; "
            f"expected {windows}"
        )
        if len(recorded) == windows - 1 and sizes[-1] < k:
            hint = "step after the last window too, even when it holds fewer than K"
        elif len(recorded) > windows:
            hint = "step once per window of K micro-batches, not after every micro-batch"
        else:
            hint = "one optimizer.step() and optimizer.zero_grad() at the end of each window"
        return make_finding(case, detail, hint)
    if syncs != windows:
        detail = f"DDP all-reduced the gradients {syncs} time(s) for {windows} optimizer steps"
        if syncs > windows:
            hint = (
                "run the forward and the backward of every micro-batch but the window's last "
                "inside model.no_sync(): DDP decides in forward whether backward all-reduces"
            )
        else:
            hint = (
                "the window's last micro-batch must run outside no_sync: its backward "
                "all-reduces what accumulated; without it each rank steps with its own gradients"
            )
        return make_finding(case, detail, hint)
    for w, (got, want) in enumerate(zip(recorded, reference_grads)):
        if same_tensors(got, want):
            continue
        detail = (
            f"at optimizer step {w + 1} (a window of {sizes[w]}) the gradients differ from one "
            f"process's on that window's global batch"
        )
        if same_tensors(got, [g * sizes[w] for g in want]):
            detail += f": they are {sizes[w]} times too large"
            hint = "divide each micro-batch's loss by the number of micro-batches in its window"
        elif sizes[w] < k and same_tensors(got, [g * sizes[w] / k for g in want]):
            detail += f": {sizes[w]}/{k} of what they should be"
            hint = f"the last window holds {sizes[w]} micro-batch(es), not K={k}: divide by that"
        elif w > 0 and same_tensors(got, [g + h for g, h in zip(want, recorded[w - 1])]):
            detail += ": they still hold the previous window's"
            hint = "call optimizer.zero_grad() after each optimizer.step()"
        else:
            hint = "average the window's micro-batch losses, with no_sync on all but the last"
        return make_finding(case, detail, hint)
    if not same_tensors(weights, reference_weights):
        return make_finding(
            case,
            "the gradients were right at every step, but the final weights differ",
            "change the weights only through optimizer.step(), once per window",
        )
    return make_finding(case)


EXERCISE = Exercise(
    key="accumulate",
    name="accumulate",
    functions=("accumulate",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.accumulate,),
    hang_hint="the ranks must run the same number of backward passes outside no_sync: each one "
    "all-reduces, and a rank that skips one leaves the others waiting",
)
