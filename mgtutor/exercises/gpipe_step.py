"""Notebook 15's exercise: one GPipe step of a pipeline stage, built from send and recv.

The learner writes ``gpipe_step(stage_module, micro_batches, targets, loss_fn)``; every rank
calls it with its own stage (rank r holds layer r of the model). Each rank computes the
expected gradients of its layer from the whole model in one process, so no rank trusts another,
and counts the learner's messages by wrapping ``dist.send``, ``isend``, ``recv`` and ``irecv``
while the learner's function runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import Finding, call_learner, everyone_ok, make_finding

__all__ = ["CASES", "EXERCISE", "check_gpipe_step", "run"]

HIDDEN = 4
CASES = (  # label, micro-batches, rows in each, seed
    ("4 micro-batches of 2 rows through 3 stages", 4, 2, 0),
    ("1 micro-batch of 3 rows: no pipelining at all, the same messages", 1, 3, 1),
    ("6 micro-batches of 1 row", 6, 1, 2),
)


def check_gpipe_step(gpipe_step: Callable[..., Any], *, timeout: float = 30.0) -> CheckResult:
    """Check one GPipe step of a pipeline stage built from send and recv, as in notebook 15.

    The exercise: write ``gpipe_step(stage_module, micro_batches, targets, loss_fn) -> None``.
    Rank r holds stage r (``stage_module``); every rank gets the same micro-batches and
    targets. Stage 0 feeds the micro-batches through its layer; every other stage receives
    each activation from rank r - 1 (it has a micro-batch's shape) and sends its output on;
    the last stage computes ``loss_fn(output, target)``. Then every micro-batch backward, the
    gradient of each stage's input sent back to rank r - 1. The step's loss is the sum of the
    micro-batches' losses; the gradients are left in the stage's ``.grad``.

    The checker runs it on 3 ranks (so one stage both receives and sends each way) with 4, 1
    and 6 micro-batches, counts the messages each rank sends and receives (one activation and
    one gradient per micro-batch at each boundary) and compares each stage's gradients with
    the whole model's in one process.

    Args:
        gpipe_step: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``gpipe_step`` is not a function.
    """
    return check(EXERCISE, (gpipe_step,), timeout)


def _sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _case(world: int, n_micro: int, rows: int, seed: int) -> tuple[nn.Sequential, list, list]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(world)]
    )
    model = model.double()
    x = torch.randn(n_micro, rows, HIDDEN, generator=gen, dtype=torch.float64)
    y = torch.randn(n_micro, rows, HIDDEN, generator=gen, dtype=torch.float64)
    return model, list(x), list(y)


@contextmanager
def _counting() -> Iterator[dict[str, list[int]]]:
    """Count the learner's point-to-point messages, by peer, while the block runs."""
    counts: dict[str, list[int]] = {"sent to": [], "received from": []}
    originals = {name: getattr(dist, name) for name in ("send", "isend", "recv", "irecv")}

    def wrap(name: str, key: str, peer_arg: str) -> Any:
        def counted(tensor: torch.Tensor, peer: int | None = None, *args: Any, **kwargs: Any):
            peer = kwargs.get(peer_arg, peer)
            if peer is None:
                raise ValueError(
                    f"dist.{name} was given no {peer_arg}: pass the peer's rank as {peer_arg}= "
                    "(this exercise counts each stage's messages by peer)"
                )
            counts[key].append(peer)
            if peer_arg in kwargs:
                return originals[name](tensor, *args, **kwargs)
            return originals[name](tensor, peer, *args, **kwargs)

        return counted

    for name in ("send", "isend"):
        setattr(dist, name, wrap(name, "sent to", "dst"))
    for name in ("recv", "irecv"):
        setattr(dist, name, wrap(name, "received from", "src"))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    (fn,) = cloudpickle.loads(payload)
    rank, world = dist.get_rank(), dist.get_world_size()
    findings = []
    for case, n_micro, rows, seed in CASES:
        model, xs, ys = _case(world, n_micro, rows, seed)
        stage = copy.deepcopy(model[rank])
        with _counting() as counts:
            call_learner(
                index, case, fn, stage, [x.clone() for x in xs], [y.clone() for y in ys], _sum_mse
            )
        dist.barrier()
        findings.append(_diagnose(case, stage, model, xs, ys, counts, rank, world))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters()]


def _reference_grads(module: nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in module.parameters():
        assert p.grad is not None  # the one-process model: its loss reaches every parameter
        grads.append(p.grad)
    return grads


def _close(got: list, want: list) -> bool:
    return all(
        g is not None and torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want)
    )


def _diagnose(
    case: str,
    stage: nn.Module,
    model: nn.Sequential,
    xs: list,
    ys: list,
    counts: dict[str, list[int]],
    rank: int,
    world: int,
) -> Finding:
    n_micro = len(xs)
    expected_counts = {
        "sent to": [rank + 1] * n_micro * (rank < world - 1) + [rank - 1] * n_micro * (rank > 0),
        "received from": [rank - 1] * n_micro * (rank > 0)
        + [rank + 1] * n_micro * (rank < world - 1),
    }
    for key, peers in counts.items():
        for peer in sorted(set(expected_counts[key]) | set(peers)):
            n_got, n_want = peers.count(peer), expected_counts[key].count(peer)
            if n_got != n_want:
                what = "activations" if (peer > rank) == (key == "sent to") else "gradients"
                return make_finding(
                    case,
                    f"stage {rank} {key} rank {peer} {n_got} message(s), expected {n_want}: "
                    f"one of the {what} per micro-batch",
                    "with dist.send/isend and dist.recv/irecv, each micro-batch's activation "
                    "goes forward once and the gradient of it comes back once, at every "
                    "boundary between stages (not the whole batch at once, not a collective)",
                )
    model.zero_grad(set_to_none=True)
    torch.stack([_sum_mse(model(x), y) for x, y in zip(xs, ys)]).sum().backward()
    want = _reference_grads(model[rank])
    got = _grads(stage)
    if _close(got, want):
        return make_finding(case)
    if any(g is None for g in got):
        return make_finding(
            case,
            f"stage {rank}'s parameters have no gradient after the step",
            "run backward on every stage: the last from its loss, the others from the "
            "gradient of their output received from the next stage (output.backward(grad))",
        )
    every = [g for g in got if g is not None]  # all of got, now that none is None
    if n_micro > 1 and _close(every, [w / n_micro for w in want]):
        return make_finding(
            case,
            f"stage {rank}'s gradients are the expected ones divided by {n_micro}, the number "
            "of micro-batches",
            "the step's loss is the sum of the micro-batches' losses: do not divide (torch's "
            "schedules divide by default, scale_grads=True, for a loss that is a mean)",
        )
    model.zero_grad(set_to_none=True)
    _sum_mse(model(xs[-1]), ys[-1]).backward()
    if n_micro > 1 and _close(every, _reference_grads(model[rank])):
        return make_finding(
            case,
            f"stage {rank}'s gradients are those of the last micro-batch alone",
            "the micro-batches' gradients add up in .grad: do not zero them between "
            "micro-batches (zero them before the step, if at all)",
        )
    return make_finding(
        case,
        f"stage {rank}'s gradients differ from one process's (largest difference "
        f"{max((g - w).abs().max().item() for g, w in zip(every, want)):.3g})",
        "stage r's forward takes the activation received from rank r - 1 (the micro-batch "
        "itself on rank 0) and sends its output to rank r + 1; the last stage adds "
        "loss_fn(output, target) per micro-batch; backward goes the other way",
        knock_on=True,
    )


EXERCISE = Exercise(
    key="gpipe_step",
    name="gpipe_step",
    functions=("gpipe_step",),
    world_size=3,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.gpipe_step,),
    hang_hint="a recv that no send matches waits forever: stage r receives activations from rank "
    "r - 1 and gradients from rank r + 1, as many of each as there are micro-batches; "
    "the first stage receives no activation and the last no gradient",
    raise_hints={
        "TypeError": "a send of None (got <class 'NoneType'>) is the gradient of a "
        "received activation that did not require grad: call x.requires_grad_(True) "
        "after the recv, or backward leaves x.grad as None and there is nothing to send "
        "back",
    },
)
