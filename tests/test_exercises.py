"""The exercise checkers pass the reference solutions and catch plausible wrong answers.

Each checker's wrong answers run in one launch with its reference (``exercises._check`` takes
several candidates), so the whole file costs a handful of launches.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mgtutor import _solutions as solutions
from mgtutor import exercises
from mgtutor.exercises import CheckResult

# The checkers serve the notebooks, which run on the newest torch only. On the 2.4.1 floor the
# snapshot checker's second process group (destroy, then init on a PrefixStore) hung in 2 of 3
# runs, and a rank of such a run outlived its test, busy for seconds: not run there.
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6),
    reason=f"the exercises run with the notebooks' torch (>= 2.6), not {torch.__version__}",
)

# --- wrong answers, as a learner could write them -----------------------------------------


def ring_sum(tensor):
    """The ring of notebook 02, on tensor_split pieces: the sum, never divided."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world))
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[into])
        request = dist.isend(chunks[out], dst=(rank + 1) % world)
        dist.recv(incoming, src=(rank - 1) % world)
        request.wait()
        chunks[into] += incoming
    for step in range(world - 1):
        out, into = (rank - step + 1) % world, (rank - step) % world
        request = dist.isend(chunks[out], dst=(rank + 1) % world)
        dist.recv(chunks[into], src=(rank - 1) % world)
        request.wait()


def ring_off_by_one_piece(tensor):
    """The all-gather starts from the piece the reduce-scatter began with, not the finished one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world))
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[into])
        request = dist.isend(chunks[out], dst=(rank + 1) % world)
        dist.recv(incoming, src=(rank - 1) % world)
        request.wait()
        chunks[into] += incoming
    for piece in chunks:
        piece /= world
    for step in range(world - 1):
        out, into = (rank - step) % world, (rank - step - 1) % world
        request = dist.isend(chunks[out], dst=(rank + 1) % world)
        dist.recv(chunks[into], src=(rank - 1) % world)
        request.wait()


def ring_by_all_reduce(tensor):
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()


def ring_returns_a_copy(tensor):
    result = tensor.clone()
    solutions.ring_average(result)
    return result


def accuracy_with_repeats(correct, sampler):
    counts = torch.tensor([float(correct.sum())])
    dist.all_reduce(counts)
    return counts.item() / sampler.total_size


def accuracy_of_this_rank(correct, sampler):
    positions = sampler.rank + sampler.num_replicas * torch.arange(len(correct))
    real = correct[positions < len(sampler.dataset)]
    return real.float().mean().item()


def accuracy_mean_of_means(correct, sampler):
    positions = sampler.rank + sampler.num_replicas * torch.arange(len(correct))
    real = correct[positions < len(sampler.dataset)]
    mean = torch.tensor([real.float().mean().item()])
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def accuracy_raises_on_rank_1(correct, sampler):
    if dist.get_rank() == 1:
        raise ValueError("no samples here")
    return solutions.exact_accuracy(correct, sampler)


def accuracy_waits_for_a_message_never_sent(correct, sampler):
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    return 0.5


def _accumulate(
    model, optimizer, micro_batches, k, *, no_sync_around, divide, step_last=True, zero_grad=True
):
    for start in range(0, len(micro_batches), k):
        window = micro_batches[start : start + k]
        if len(window) < k and not step_last:
            break
        for i, (x, y) in enumerate(window):
            pause = contextlib.nullcontext if i == len(window) - 1 else model.no_sync
            forward = pause() if no_sync_around == "both" else contextlib.nullcontext()
            with forward:
                loss = F.mse_loss(model(x), y) / divide(len(window), k)
            backward = (
                pause() if no_sync_around in ("both", "backward") else contextlib.nullcontext()
            )
            with backward:
                loss.backward()
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()


def accumulate_without_no_sync(model, optimizer, micro_batches, k):
    _accumulate(model, optimizer, micro_batches, k, no_sync_around=None, divide=lambda n, k: n)


def accumulate_no_sync_around_backward(model, optimizer, micro_batches, k):
    _accumulate(
        model, optimizer, micro_batches, k, no_sync_around="backward", divide=lambda n, k: n
    )


def accumulate_undivided(model, optimizer, micro_batches, k):
    _accumulate(model, optimizer, micro_batches, k, no_sync_around="both", divide=lambda n, k: 1)


def accumulate_divided_by_k(model, optimizer, micro_batches, k):
    _accumulate(model, optimizer, micro_batches, k, no_sync_around="both", divide=lambda n, k: k)


def accumulate_no_last_step(model, optimizer, micro_batches, k):
    _accumulate(
        model,
        optimizer,
        micro_batches,
        k,
        no_sync_around="both",
        divide=lambda n, k: n,
        step_last=False,
    )


def accumulate_no_zero_grad(model, optimizer, micro_batches, k):
    _accumulate(
        model,
        optimizer,
        micro_batches,
        k,
        no_sync_around="both",
        divide=lambda n, k: n,
        zero_grad=False,
    )


def _save(path, job, rng):
    import mgtutor

    state = {
        "model": job.model.module.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "epoch": job.epoch,
    }
    if rng:
        state["rng"] = torch.get_rng_state()
    if dist.get_rank() == 0:
        mgtutor.save_checkpoint(state, path)
    dist.barrier()


def _load(path, job, *, scheduler=True, epoch=True):
    import mgtutor

    state = mgtutor.load_checkpoint(path)
    job.model.module.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    if scheduler:
        job.scheduler.load_state_dict(state["scheduler"])
    if epoch:
        job.epoch = state["epoch"]
    if "rng" in state:  # one state (saved by rank 0), or every rank's (the reference's save)
        rng = state["rng"]
        torch.set_rng_state(rng[dist.get_rank()] if isinstance(rng, list) else rng)


def save_without_rng(path, job):
    _save(path, job, rng=False)


def save_rank_0_rng(path, job):
    _save(path, job, rng=True)


def load_everything(path, job):
    _load(path, job)


def load_without_scheduler(path, job):
    _load(path, job, scheduler=False)


def load_without_epoch(path, job):
    _load(path, job, epoch=False)


# --- the tests ----------------------------------------------------------------------------


def _failed_with(result: CheckResult, *words: str) -> bool:
    text = f"{result.message} {result.hint}".lower()
    return result.status == "failed" and all(w.lower() in text for w in words)


def test_ring_average_passes_the_reference_and_catches_wrong_rings() -> None:
    reference, summed, shifted, collective, copied = exercises._check(
        "ring_average",
        [
            (solutions.ring_average,),
            (ring_sum,),
            (ring_off_by_one_piece,),
            (ring_by_all_reduce,),
            (ring_returns_a_copy,),
        ],
    )
    assert reference.passed, reference
    assert _failed_with(summed, "3 times the mean", "divide by the world size"), summed
    assert _failed_with(shifted, "piece", "reduce-scatter"), shifted
    assert _failed_with(collective, "dist.all_reduce", "point-to-point"), collective
    assert _failed_with(copied, "unchanged", "in place"), copied


def test_exact_accuracy_passes_the_reference_and_catches_miscounts() -> None:
    reference, repeats, own, means = exercises._check(
        "exact_accuracy",
        [
            (solutions.exact_accuracy,),
            (accuracy_with_repeats,),
            (accuracy_of_this_rank,),
            (accuracy_mean_of_means,),
        ],
    )
    assert reference.passed, reference
    assert _failed_with(repeats, "padded repeats"), repeats
    assert _failed_with(own, "this rank's own figure"), own
    assert _failed_with(means, "mean of the ranks' accuracies"), means


def test_accumulation_passes_the_reference_and_catches_each_classic_mistake() -> None:
    results = exercises._check(
        "accumulate",
        [
            (solutions.accumulate,),
            (accumulate_without_no_sync,),
            (accumulate_no_sync_around_backward,),
            (accumulate_undivided,),
            (accumulate_divided_by_k,),
            (accumulate_no_last_step,),
            (accumulate_no_zero_grad,),
        ],
    )
    reference, no_sync, backward_only, undivided, by_k, no_last, no_zero = results
    assert reference.passed, reference
    assert _failed_with(
        no_sync, "all-reduced the gradients 8 time(s)", "forward and the backward"
    ), no_sync
    assert _failed_with(backward_only, "8 time(s)", "forward and the backward"), backward_only
    assert _failed_with(undivided, "4 times too large", "divide each"), undivided
    assert _failed_with(by_k, "windows of 2, 2 and 1", "1/2 of what", "holds 1"), by_k
    assert _failed_with(no_last, "ran 2 time(s)", "step after the last window"), no_last
    assert _failed_with(no_zero, "previous window", "zero_grad"), no_zero


def test_snapshot_passes_the_reference_and_catches_what_it_forgets() -> None:
    reference, no_rng, rank_0_rng, no_scheduler, no_epoch = exercises._check(
        "snapshot",
        [
            (solutions.save_snapshot, solutions.load_snapshot),
            (save_without_rng, load_everything),
            (save_rank_0_rng, load_everything),
            (solutions.save_snapshot, load_without_scheduler),
            (solutions.save_snapshot, load_without_epoch),
        ],
    )
    assert reference.passed, reference
    assert _failed_with(no_rng, "was not restored", "torch.get_rng_state"), no_rng
    assert _failed_with(rank_0_rng, "rank 1 restored rank 0's"), rank_0_rng
    assert _failed_with(no_scheduler, "scheduler differs", "scheduler.state_dict"), no_scheduler
    assert _failed_with(no_epoch, "job.epoch is 0"), no_epoch


def test_a_stub_is_not_attempted_and_shows_the_reference_passing() -> None:
    def exact_accuracy(correct, sampler):
        """Your answer."""
        raise NotImplementedError  # your code here

    result = exercises.check_exact_accuracy(exact_accuracy)
    assert result.status == "not attempted" and not result.passed
    assert result.reference is not None and result.reference.passed
    assert "NOT ATTEMPTED" in repr(result) and "PASSED" in repr(result)
    assert "not attempted" in result._repr_html_().lower()


def test_a_function_that_raises_is_reported_with_its_rank_and_traceback() -> None:
    (result,) = exercises._check("exact_accuracy", [(accuracy_raises_on_rank_1,)])
    assert _failed_with(result, "rank 1 raised ValueError: no samples here"), result
    assert 'raise ValueError("no samples here")' in result.message


def test_a_function_that_hangs_is_stopped_and_reported() -> None:
    (result,) = exercises._check(
        "exact_accuracy", [(accuracy_waits_for_a_message_never_sent,)], timeout=2
    )
    assert _failed_with(result, "did not finish within 2 s", "every rank"), result


def test_stubs_are_recognized_without_running() -> None:
    def stub(x):
        raise NotImplementedError  # your code here

    def documented_stub(x):
        """Docstring."""
        raise NotImplementedError("write me")

    def started(x):
        print(x)
        raise NotImplementedError

    assert exercises._is_stub(stub) and exercises._is_stub(documented_stub)
    assert not exercises._is_stub(started) and not exercises._is_stub(solutions.ring_average)
    with pytest.raises(TypeError, match="pass the function itself"):
        exercises.check_ring_average(None)


def test_results_read_well_as_text_and_html() -> None:
    result = CheckResult("f", "failed", "Case 'x', rank 1: wrong <b>.", hint="look.", cases=("x",))
    assert repr(result) == "f: FAILED\n  Case 'x', rank 1: wrong <b>.\n  Hint: look."
    assert "&lt;b&gt;" in result._repr_html_() and "<li>x</li>" in result._repr_html_()
    assert not result.passed and CheckResult("f", "passed", "ok").passed
