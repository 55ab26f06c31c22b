"""What the exercise checks run inside each rank: the cases, the learner's call, the diagnosis.

:mod:`mgtutor.exercises` launches :func:`run_candidates` on CPU ranks. For every candidate (a
learner's function, or a tuple of them) it builds each case's inputs the same way on every
rank, calls the candidate, and compares what came out with what must come out. The expected
result is computed on each rank from all ranks' inputs, without any collective, so a wrong
answer cannot hide behind a reference that shares its mistake (the checker's own collectives
only let the ranks agree to stop at the first failing case). Each case yields a finding,
``{"case", "ok", "detail", "hint", "knock_on"}``; the notebook's process turns the first
failing one into the verdict.

A candidate that raises is reported as :class:`LearnerFailed`, carrying which candidate, which
case, which rank, and the learner's own part of the traceback.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

__all__ = ["EXERCISE_RUNNERS", "LearnerFailed", "TrainingJob", "run_candidates"]

Finding = dict[str, Any]

_FAILURE_MARK = "mgtutor-exercise-failure:"


class LearnerFailed(Exception):
    """The learner's function raised in one rank while a check ran it.

    Its message is machine-readable (the notebook's process parses it when the exception object
    itself cannot be sent back); the attributes say the same.
    """

    def __init__(
        self, index: int, case: str, rank: int, exc_type: str, message: str, where: str
    ) -> None:
        super().__init__(index, case, rank, exc_type, message, where)
        self.index, self.case, self.rank = index, case, rank
        self.exc_type, self.message, self.where = exc_type, message, where

    def __str__(self) -> str:
        return _FAILURE_MARK + json.dumps(self.args)

    @classmethod
    def parse(cls, text: str) -> LearnerFailed | None:
        """Rebuild one from its message, or None if ``text`` is not such a message."""
        start = text.find(_FAILURE_MARK)
        if start < 0:
            return None
        try:
            return cls(*json.JSONDecoder().raw_decode(text[start + len(_FAILURE_MARK) :])[0])
        except (ValueError, TypeError):
            return None


class ForbiddenCollective(RuntimeError):
    """Raised in place of a collective that an exercise asks to build from messages instead."""


def _learner_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # this module's frames: the learner's own start below them
    frames = traceback.extract_tb(tb)[-6:]
    return "".join(traceback.format_list(frames)) + f"{type(exc).__name__}: {exc}"


def _call(index: int, case: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        raise LearnerFailed(
            index, case, dist.get_rank(), type(exc).__name__, str(exc), _learner_traceback(exc)
        ) from None


def _finding(case: str, detail: str = "", hint: str = "", *, knock_on: bool = False) -> Finding:
    # knock_on: a symptom another rank's mistake can cause here; the verdict prefers a rank
    # whose finding names the mistake itself.
    return {"case": case, "ok": not detail, "detail": detail, "hint": hint, "knock_on": knock_on}


def _everyone_ok(finding: Finding) -> bool:
    """Whether every rank's finding for this case is right (a collective: call it on all).

    A candidate's cases stop at the first one that fails on any rank: its later cases could
    raise or hang for the same mistake, and the verdict reports the first failure anyway.
    """
    flag = torch.tensor([1 if finding["ok"] else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# --- ring average ---------------------------------------------------------------------------

RING_CASES = (  # label, shape, dtype
    ("12 float64 values (4 per rank)", (12,), torch.float64),
    ("10 float32 values (pieces of 4, 3 and 3)", (10,), torch.float32),
    ("a 4x5 float32 matrix", (4, 5), torch.float32),
    ("2 float64 values on 3 ranks (fewer values than ranks)", (2,), torch.float64),
    ("7 float16 values", (7,), torch.float16),
    ("a single number (a 0-d tensor, like a loss)", (), torch.float32),
)
_TOLERANCE = {torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}
# Everything that would do the exercise's work in one call; point-to-point messages
# (send, recv, isend, irecv, batch_isend_irecv) and barrier stay allowed.
_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


def _refusal(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ForbiddenCollective(
            f"dist.{name} was called; this exercise builds the all-reduce from send/recv"
        )

    return refuse


@contextlib.contextmanager
def _collectives_refused() -> Iterator[None]:
    """Replace the collectives with functions that raise, in both modules that export them.

    The learner's function is unpickled inside this block too, so a collective it imported by
    name (``from torch.distributed import all_reduce``) resolves to the refusing one as well.
    """
    from torch.distributed import distributed_c10d

    saved = []
    for module in (dist, distributed_c10d):
        for name in _COLLECTIVES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _refusal(name))
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _ring_input(case: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(-20, 21, shape, generator=generator).to(dtype)  # exact sums


def _ring_average(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with _collectives_refused():
        (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, shape, dtype) in enumerate(RING_CASES):
        inputs = [_ring_input(number, r, shape, dtype) for r in range(world)]
        expected = (sum(t.double() for t in inputs) / world).to(dtype)
        tensor = inputs[rank].clone()
        try:
            with _collectives_refused():
                returned = _call(index, case, fn, tensor)
        except LearnerFailed as failure:
            if failure.exc_type != ForbiddenCollective.__name__:
                raise
            findings.append(
                _finding(
                    case,
                    f"it called a collective: {failure.message.split(';')[0]}",
                    "build the average from point-to-point messages only (dist.isend, "
                    "dist.recv, dist.irecv, dist.send): the collectives are what you rebuild",
                )
            )
        else:
            findings.append(_diagnose_ring(case, tensor, returned, inputs[rank], expected, world))
        if not _everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_ring(
    case: str,
    tensor: torch.Tensor,
    returned: Any,
    original: torch.Tensor,
    expected: torch.Tensor,
    world: int,
) -> Finding:
    tolerance = _TOLERANCE[expected.dtype]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(
            a.double(), b.double(), rtol=tolerance, atol=tolerance
        )

    if tensor.dtype != expected.dtype or tensor.shape != expected.shape:
        return _finding(
            case,
            f"the tensor became {tensor.dtype} of shape {tuple(tensor.shape)}",
            "keep the tensor's shape and dtype: write the mean into it (its pieces as views)",
        )
    if close(tensor, expected):
        return _finding(case)
    if isinstance(returned, torch.Tensor) and close(returned.reshape(expected.shape), expected):
        return _finding(
            case,
            "returned the mean but left the tensor it was given unchanged",
            "work in place, like dist.all_reduce: tensor.copy_(result), or add into views of "
            "tensor (tensor.view(-1).tensor_split(world_size) gives such views)",
        )
    if torch.equal(tensor, original):
        return _finding(
            case,
            "the tensor is unchanged",
            "write into the tensor itself: views of it (tensor.view(-1).tensor_split(...)), "
            "in-place operations (+=, div_, recv into a view)",
        )
    if close(tensor, expected * world):
        return _finding(
            case,
            f"every value is {world} times the mean: the sum over the ranks",
            "divide by the world size: the sum is the ring's result, the mean is the exercise's",
        )
    wrong = ~torch.isclose(tensor.double(), expected.double(), rtol=tolerance, atol=tolerance)
    flat = wrong.view(-1)
    pieces = [p for p, part in enumerate(flat.tensor_split(world)) if part.any()]
    first = int(flat.nonzero()[0])
    return _finding(
        case,
        f"{int(flat.sum())} of {flat.numel()} values are wrong, in piece(s) {pieces} of the "
        f"{world} that tensor_split(world_size) cuts the flattened tensor into; value {first}: "
        f"{tensor.view(-1)[first].item():g}, expected {expected.view(-1)[first].item():g}",
        "in the reduce-scatter, at step s rank r sends piece (r - s) % world and adds the piece "
        "(r - s - 1) % world it receives; after world - 1 steps it holds the finished piece "
        "(r + 1) % world, which the all-gather passes on. Note that tensor.chunk(n) can return "
        "fewer than n pieces; tensor_split(n) always returns n",
    )


# --- exact accuracy -------------------------------------------------------------------------

ACCURACY_CASES = (  # label, samples, shuffle, drop_last
    ("11 samples, shuffle=False: the sampler repeats 1", 11, False, False),
    ("13 samples, shuffle=True: the sampler repeats 1", 13, True, False),
    ("12 samples: no repeat", 12, True, False),
    ("1 sample on 2 ranks: rank 1 holds only the repeat", 1, False, False),
    ("11 samples, drop_last=True: 1 left out, none repeated", 11, True, True),
)


def _exact_accuracy(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for case, n, shuffle, drop_last in ACCURACY_CASES:
        options = {"shuffle": shuffle, "seed": 0, "drop_last": drop_last}
        shards = [
            list(DistributedSampler(range(n), num_replicas=world, rank=r, **options))
            for r in range(world)
        ]
        padded = [shards[p % world][p // world] for p in range(world * len(shards[0]))]
        truth = torch.tensor([i % 3 == 0 for i in range(n)])  # the figures below all differ
        truth[padded[n:]] = True  # the repeats are right: counting them raises the accuracy
        sampler = DistributedSampler(range(n), **options)
        got = _call(index, case, fn, truth[list(sampler)].clone(), sampler)
        findings.append(_diagnose_accuracy(case, got, truth, shards, padded, n, rank))
        if not _everyone_ok(findings[-1]):
            break
    return findings


def _diagnose_accuracy(
    case: str,
    got: Any,
    truth: torch.Tensor,
    shards: list[list[int]],
    padded: list[int],
    n: int,
    rank: int,
) -> Finding:
    try:
        value = float(got)
    except (TypeError, ValueError, RuntimeError):
        return _finding(
            case,
            f"returned {type(got).__name__} {got!r:.60}",
            "return one number, the same on every rank (a Python float, or tensor.item())",
        )
    world = len(shards)
    seen = sorted(set(padded))  # every index handed out, once
    correct = int(truth[seen].sum())
    exact = correct / len(seen)
    # float32 counts are exact; only the final division may round (about 1e-8). Miscounts on
    # these few samples are off by far more.
    if abs(value - exact) < 1e-6:
        return _finding(case)
    # Rank r's i-th index sits at position r + i * world of the padded order; from n on: repeats.
    real = [[i for p, i in enumerate(shard) if r + p * world < n] for r, shard in enumerate(shards)]
    padded_correct = int(truth[padded].sum())
    candidates = {
        "repeats": padded_correct / len(padded),
        "repeats over the true count": padded_correct / len(seen),
        "own shard": float(truth[shards[rank]].float().mean()),
    }
    if all(real):
        candidates["mean of means"] = sum(float(truth[s].float().mean()) for s in real) / world
        candidates["own real shard"] = float(truth[real[rank]].float().mean())
    match = next((k for k, v in candidates.items() if abs(value - v) < 1e-6), None)
    detail = f"returned {value:.6f}, expected {exact:.6f} ({correct} right of {len(seen)})"
    hints = {
        "repeats": "that counts the sampler's padded repeats: of rank r's indices, the i-th "
        "sits at position r + i * num_replicas of the padded order, and the positions from "
        "len(sampler.dataset) on are repeats; leave them out of both counts",
        "repeats over the true count": "the correct count includes the padded repeats: "
        "leave out the positions from len(sampler.dataset) on before summing",
        "own shard": "that is this rank's own figure: sum the correct count and the sample "
        "count over all ranks (one all_reduce, or mgtutor.reduce_sums) and divide the sums",
        "own real shard": "that is this rank's own figure: sum the correct count and the "
        "sample count over all ranks (one all_reduce, or mgtutor.reduce_sums)",
        "mean of means": "that is the mean of the ranks' accuracies; the ranks hold different "
        "numbers of real samples, so sum the counts over the ranks and divide once",
    }
    if match is not None:
        return _finding(case, f"{detail}; that is {match!r}", hints[match])
    return _finding(
        case, detail, "count each index the sampler hands out once, over all ranks, and divide"
    )


# --- gradient accumulation with no_sync -----------------------------------------------------

ACCUMULATION_CASES = (  # label, micro-batches per rank, K
    ("8 micro-batches, K=4: 2 optimizer steps", 8, 4),
    ("5 micro-batches, K=2: windows of 2, 2 and 1", 5, 2),
    ("3 micro-batches, K=1: a step after each", 3, 1),
)
_MICRO_BATCH, _FEATURES = 3, 5


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
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


def _accumulation(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    rank, world = dist.get_rank(), dist.get_world_size()
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, m, k) in enumerate(ACCUMULATION_CASES):
        generator = torch.Generator().manual_seed(number)
        shape = (world, m, _MICRO_BATCH)
        xs = torch.randn(*shape, _FEATURES, dtype=torch.float64, generator=generator)
        ys = torch.randn(*shape, 1, dtype=torch.float64, generator=generator)
        reference_grads, reference_weights = _one_process(xs, ys, k)
        model = DDP(_accumulation_model())
        counts = _sync_counter(model)
        optimizer = _RecordingSGD(model.parameters(), lr=0.1)
        micro_batches = [(xs[rank, j], ys[rank, j]) for j in range(m)]
        _call(index, case, fn, model, optimizer, micro_batches, k)
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
        if not _everyone_ok(findings[-1]):
            break
    return findings


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        u is not None and torch.allclose(u, v, rtol=1e-9, atol=1e-12) for u, v in zip(a, b)
    )


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
        return _finding(case, detail, hint)
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
        return _finding(case, detail, hint)
    for w, (got, want) in enumerate(zip(recorded, reference_grads)):
        if _same(got, want):
            continue
        detail = (
            f"at optimizer step {w + 1} (a window of {sizes[w]}) the gradients differ from one "
            f"process's on that window's global batch"
        )
        if _same(got, [g * sizes[w] for g in want]):
            detail += f": they are {sizes[w]} times too large"
            hint = "divide each micro-batch's loss by the number of micro-batches in its window"
        elif sizes[w] < k and _same(got, [g * sizes[w] / k for g in want]):
            detail += f": {sizes[w]}/{k} of what they should be"
            hint = f"the last window holds {sizes[w]} micro-batch(es), not K={k}: divide by that"
        elif w > 0 and _same(got, [g + h for g, h in zip(want, recorded[w - 1])]):
            detail += ": they still hold the previous window's"
            hint = "call optimizer.zero_grad() after each optimizer.step()"
        else:
            hint = "average the window's micro-batch losses, with no_sync on all but the last"
        return _finding(case, detail, hint)
    if not _same(weights, reference_weights):
        return _finding(
            case,
            "the gradients were right at every step, but the final weights differ",
            "change the weights only through optimizer.step(), once per window",
        )
    return _finding(case)


# --- a resumable snapshot -------------------------------------------------------------------


@dataclass
class TrainingJob:
    """Everything a training loop carries from step to step, as the snapshot exercise sees it.

    Attributes:
        model: the DDP-wrapped model (``model.module`` is the plain one).
        optimizer: its Adam optimizer.
        scheduler: a cosine learning-rate schedule, stepped after every optimizer step.
        sampler: the ``DistributedSampler`` of the training data (the loop calls its
            ``set_epoch(job.epoch)`` at the start of each epoch).
        epoch: the next epoch to train (after epoch 0 is done, 1).
    """

    model: DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: DistributedSampler
    epoch: int = 0


SNAPSHOT_EPOCHS, _SNAPSHOT_SAMPLES, _SNAPSHOT_BATCH = 2, 16, 4


def _new_job() -> tuple[TrainingJob, DataLoader]:
    """The job as a (re)started script builds it: seeded per rank, from scratch."""
    torch.manual_seed(1 + dist.get_rank())  # each rank draws its own augmentation noise
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_SNAPSHOT_SAMPLES, 4, dtype=torch.float64, generator=generator)
    data = TensorDataset(x, x.sum(1, keepdim=True).tanh())
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=_SNAPSHOT_BATCH, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=SNAPSHOT_EPOCHS * len(loader)
    )
    return TrainingJob(model, optimizer, scheduler, sampler), loader


def _train_epoch(job: TrainingJob, loader: DataLoader) -> list[float]:
    job.sampler.set_epoch(job.epoch)
    losses = []
    for x, y in loader:  # iterating a DataLoader also draws from torch's generator
        x = x + 0.1 * torch.randn_like(x)  # augmentation noise
        loss = F.mse_loss(job.model(x), y)
        job.optimizer.zero_grad()
        loss.backward()
        job.optimizer.step()
        job.scheduler.step()
        losses.append(loss.item())
    job.epoch += 1
    return losses


def _state(job: TrainingJob) -> dict[str, Any]:
    return {
        "epoch": job.epoch,
        "model": copy.deepcopy(job.model.module.state_dict()),
        "optimizer": copy.deepcopy(job.optimizer.state_dict()),
        "scheduler": copy.deepcopy(job.scheduler.state_dict()),
        "rng": torch.get_rng_state(),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b))
    return a == b


def _restart_process_group(tag: str) -> None:
    """Leave the process group and form a new one, as a restarted job's fresh processes do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group("gloo", store=dist.PrefixStore(tag, store), rank=rank, world_size=world)


def _snapshot(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    save, load = cloudpickle.loads(payload)
    rank = dist.get_rank()
    path = os.path.join(folder or ".", f"candidate{index}", "snapshot.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)  # torch.save does not create folders
    case = "save after epoch 0, restart, load, train epoch 1"
    job, loader = _new_job()
    _train_epoch(job, loader)
    _call(index, "save_snapshot after epoch 0", save, path, job)
    saved = _state(job)
    uninterrupted = _train_epoch(job, loader)
    final = [p.detach().clone() for p in job.model.parameters()]
    saved_rngs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(saved_rngs, saved["rng"])

    del job, loader
    _restart_process_group(f"mgtutor-exercise-restart-{index}")
    job, loader = _new_job()
    fresh_rng = torch.get_rng_state()
    _call(index, "load_snapshot in the restarted job", load, path, job)
    loaded = _state(job)
    resumed: list[float] = []
    for _ in range(SNAPSHOT_EPOCHS):
        if job.epoch >= SNAPSHOT_EPOCHS:
            break
        resumed += _train_epoch(job, loader)
    after = [p.detach().clone() for p in job.model.parameters()]
    return [
        _diagnose_snapshot(
            case, rank, saved, loaded, saved_rngs, fresh_rng, uninterrupted, resumed, final, after
        )
    ]


def _diagnose_snapshot(
    case: str,
    rank: int,
    saved: dict[str, Any],
    loaded: dict[str, Any],
    saved_rngs: list[torch.Tensor],
    fresh_rng: torch.Tensor,
    uninterrupted: list[float],
    resumed: list[float],
    final: list[torch.Tensor],
    after: list[torch.Tensor],
) -> Finding:
    if loaded["epoch"] != saved["epoch"]:
        return _finding(
            case,
            f"after loading, job.epoch is {loaded['epoch']}; the snapshot was taken with "
            f"job.epoch = {saved['epoch']}",
            "save job.epoch and set it back when loading: the loop resumes at job.epoch",
        )
    parts = {
        "model": "the model's weights: job.model.module.state_dict()",
        "optimizer": "the optimizer's state (Adam's moments and step counts): "
        "job.optimizer.state_dict()",
        "scheduler": "the learning-rate schedule: job.scheduler.state_dict()",
    }
    for key, what in parts.items():
        if not _equal(loaded[key], saved[key]):
            return _finding(
                case,
                f"after loading, {key} differs from what it was when the snapshot was taken",
                f"save and restore {what}",
            )
    if not torch.equal(loaded["rng"], saved["rng"]):
        others = [r for r, state in enumerate(saved_rngs) if torch.equal(loaded["rng"], state)]
        if others:
            return _finding(
                case,
                f"rank {rank} restored rank {others[0]}'s random generator state, not its own",
                "each rank draws its own random numbers: gather every rank's "
                "torch.get_rng_state() (dist.gather_object to rank 0, or one file per rank) "
                "and let each rank restore its own",
            )
        unrestored = torch.equal(loaded["rng"], fresh_rng)
        return _finding(
            case,
            "torch's random generator "
            + ("was not restored: " if unrestored else "differs from the snapshot's: ")
            + "the restarted job draws other augmentation noise (and DataLoader seeds)",
            "save torch.get_rng_state() of every rank and restore it with torch.set_rng_state",
        )
    if resumed != uninterrupted or not _same(after, final):
        step = next(
            (i for i, (a, b) in enumerate(zip(resumed, uninterrupted)) if a != b),
            min(len(resumed), len(uninterrupted)),
        )
        return _finding(
            case,
            f"everything checked was restored, yet the resumed run's loss differs from the "
            f"uninterrupted run's at step {step + 1} of epoch 1",
            "look for other state the next step depends on",
            knock_on=True,
        )
    return _finding(case)


# --- the rank's entry point -----------------------------------------------------------------

EXERCISE_RUNNERS: dict[str, Callable[[bytes, int, str | None], list[Finding]]] = {
    "ring_average": _ring_average,
    "exact_accuracy": _exact_accuracy,
    "accumulate": _accumulation,
    "snapshot": _snapshot,
}


def run_candidates(exercise: str, payloads: list[bytes], folder: str | None) -> list[list[Finding]]:
    """Run each pickled candidate through ``exercise``'s cases; one list of findings each.

    Args:
        exercise: a key of :data:`EXERCISE_RUNNERS`.
        payloads: cloudpickled tuples of the candidate's functions.
        folder: a scratch folder the exercise may write to (the snapshot's), or None.

    Returns:
        For each candidate, one finding per case, in order.

    Raises:
        LearnerFailed: a candidate raised; the candidates after it did not run.
    """
    from mgtutor.worker import setup

    setup(backend="gloo")
    runner = EXERCISE_RUNNERS[exercise]
    reports = []
    for index, payload in enumerate(payloads):
        reports.append(runner(payload, index, folder))
        dist.barrier()
    return reports
