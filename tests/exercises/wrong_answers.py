"""Wrong answers to the exercises, as a learner could write them, grouped by exercise.

:mod:`tests.exercises.test_wrong_answers` runs each through its checker and names the message
it must get. Each function is sent to the ranks by reference, so it lives in a module.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mgtutor.exercises import solutions

# --- ring_average, notebook 02 --------------------------------------------------------------------


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


# --- exact_accuracy, notebook 03 ------------------------------------------------------------------


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


def accuracy_drops_the_last_ranks_last(correct, sampler):
    # Right on 2 ranks only, where the one repeat is always the last rank's last index.
    n, world = len(sampler.dataset), sampler.num_replicas
    keep = correct
    if not sampler.drop_last and n % world and sampler.rank == world - 1:
        keep = correct[:-1]
    counts = torch.tensor([float(keep.sum()), float(len(keep))], dtype=torch.float64)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def accuracy_raises_on_rank_1(correct, sampler):
    if dist.get_rank() == 1:
        raise ValueError("no samples here")
    return solutions.exact_accuracy(correct, sampler)


def accuracy_waits_for_a_message_never_sent(correct, sampler):
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    return 0.5


# --- accumulate, notebook 05 ----------------------------------------------------------------------


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


# --- snapshot, notebook 09 ------------------------------------------------------------------------


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


# --- global_batch_stats, notebook 04 --------------------------------------------------------------


def _channel_sums(x):
    dims = [0, *range(2, x.dim())]
    return x.numel() // x.shape[1], x.double().sum(dims), x.double().pow(2).sum(dims)


def stats_mean_of_means(x):
    """Each rank's mean and mean of squares, averaged over the ranks: fine for equal batches."""
    n, s, q = _channel_sums(x)
    moments = torch.cat([s / n, q / n])
    dist.all_reduce(moments)
    moments /= dist.get_world_size()
    mean, square = moments.chunk(2)
    return mean.float(), (square - mean**2).float()


def stats_mean_of_variances(x):
    n, s, q = _channel_sums(x)
    mean, var = s / n, q / n - (s / n) ** 2
    stats = torch.cat([mean, var])
    dist.all_reduce(stats)
    return (stats / dist.get_world_size()).chunk(2)


def stats_weighted_variances(x):
    """The right mean, but each rank's variance around its own mean, weighted by its count."""
    n, s, q = _channel_sums(x)
    stats = torch.cat(
        [torch.tensor([float(n)], dtype=torch.float64), s, n * (q / n - (s / n) ** 2)]
    )
    dist.all_reduce(stats)
    total, sums, spreads = stats[0], *stats[1:].chunk(2)
    return sums / total, spreads / total


def stats_unbiased(x):
    mean, var = solutions.global_batch_stats(x)
    total = torch.tensor([float(x.numel() // x.shape[1])])
    dist.all_reduce(total)
    return mean, var * total / (total - 1)


def stats_without_counts(x):
    """The sums all-reduced, divided by this rank's count times the number of ranks."""
    n, s, q = _channel_sums(x)
    sums = torch.cat([s, q])
    dist.all_reduce(sums)
    s, q = (sums / (n * dist.get_world_size())).chunk(2)
    return s, q - s**2


# --- checked_all_reduce, notebook 10 --------------------------------------------------------------


def reduce_unchecked(tensor):
    dist.all_reduce(tensor)


def _gathered(tensor):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tuple(tensor.shape), tensor.dtype))
    return everyone


def reduce_checking_shapes_only(tensor):
    shapes = [shape for shape, _ in _gathered(tensor)]
    if len(set(shapes)) > 1:
        raise ValueError(f"shapes differ: {dict(enumerate(shapes))}")
    dist.all_reduce(tensor)


def reduce_with_a_vague_message(tensor):
    if len(set(_gathered(tensor))) > 1:
        raise ValueError("the tensors differ between ranks")
    dist.all_reduce(tensor)


def reduce_checked_on_rank_0(tensor):
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((tuple(tensor.shape), tensor.dtype), everyone, dst=0)
    if dist.get_rank() == 0 and len(set(everyone)) > 1:
        raise ValueError(f"rank 0 {everyone[0]}, rank 1 {everyone[1]}")
    dist.all_reduce(tensor)


def reduce_gathering_shape_tensors(tensor):
    """Gathers torch.tensor(shape): its length is the number of dimensions, which can differ."""
    mine = torch.tensor(tensor.shape, dtype=torch.long)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(other, mine) for other in everyone):
        raise ValueError(f"shapes differ: {[(r, t.tolist()) for r, t in enumerate(everyone)]}")
    dist.all_reduce(tensor)


def reduce_asserting(tensor):
    everyone = _gathered(tensor)
    assert len(set(everyone)) == 1, f"rank 0 {everyone[0]}, rank 1 {everyone[1]}"
    dist.all_reduce(tensor)


# --- bytes_per_rank, notebook 12 ------------------------------------------------------------------


def bytes_with_buckets(n_params, world_size, strategy):
    return [
        x + (4 * n_params if strategy == "ddp" else 0)
        for x in solutions.bytes_per_rank(n_params, world_size, strategy)
    ]


def bytes_zero1_shards_everything(n_params, world_size, strategy):
    if strategy != "zero1":
        return solutions.bytes_per_rank(n_params, world_size, strategy)
    return [16 * (n_params // world_size + (r < n_params % world_size)) for r in range(world_size)]


def bytes_zero1_rounded_down(n_params, world_size, strategy):
    if strategy != "zero1":
        return solutions.bytes_per_rank(n_params, world_size, strategy)
    return [8 * n_params + 8 * (n_params // world_size)] * world_size


def bytes_fsdp_unpadded(n_params, world_size, strategy):
    if strategy != "fsdp":
        return solutions.bytes_per_rank(n_params, world_size, strategy)
    per_rank = -(-n_params // world_size)
    return [16 * max(0, min(per_rank, n_params - r * per_rank)) for r in range(world_size)]


def bytes_fsdp_padded_state(n_params, world_size, strategy):
    if strategy != "fsdp":
        return solutions.bytes_per_rank(n_params, world_size, strategy)
    return [16 * -(-n_params // world_size)] * world_size


def bytes_one_number(n_params, world_size, strategy):
    return solutions.bytes_per_rank(n_params, world_size, strategy)[0]


# --- assign_buckets, notebook 07 ------------------------------------------------------------------


def buckets_in_forward_order(param_sizes_bytes, cap_bytes, first_cap_bytes):
    last = len(param_sizes_bytes) - 1
    reversed_sizes = param_sizes_bytes[::-1]
    buckets = solutions.assign_buckets(reversed_sizes, cap_bytes, first_cap_bytes)
    return [[last - i for i in bucket] for bucket in buckets]


def buckets_without_a_first_cap(param_sizes_bytes, cap_bytes, first_cap_bytes):
    return solutions.assign_buckets(param_sizes_bytes, cap_bytes, cap_bytes)


def buckets_never_over_the_cap(param_sizes_bytes, cap_bytes, first_cap_bytes):
    """Closes a bucket before a parameter would take it past its cap."""
    buckets, size = [[]], 0
    for index in reversed(range(len(param_sizes_bytes))):
        cap = first_cap_bytes if len(buckets) == 1 else cap_bytes
        if buckets[-1] and size + param_sizes_bytes[index] > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += param_sizes_bytes[index]
    return buckets


# --- shard_indices, notebook 06 -------------------------------------------------------------------


def shards_by_rank_only(n_samples, rank, world_size, worker_id, num_workers):
    return list(range(rank, n_samples, world_size))


def shards_by_worker_only(n_samples, rank, world_size, worker_id, num_workers):
    return list(range(worker_id, n_samples, num_workers))


def shards_rounded_down(n_samples, rank, world_size, worker_id, num_workers):
    """Equal blocks of n // readers: the samples left over are read by nobody."""
    per = n_samples // (world_size * num_workers)
    start = (rank * num_workers + worker_id) * per
    return list(range(start, start + per))


def shards_worker_major(n_samples, rank, world_size, worker_id, num_workers):
    """Each sample once, but the leftovers all go to rank 0's workers."""
    return list(range(rank * num_workers + worker_id, n_samples, world_size * num_workers))


def shards_unpadded(n_samples, rank, world_size, worker_id, num_workers):
    """Each sample once, the ranks' counts within one: 11 samples give 4 batches against 3."""
    return list(range(rank, n_samples, world_size))[worker_id::num_workers]


def shards_padded_with_the_last(n_samples, rank, world_size, worker_id, num_workers):
    """Every rank alike, but padded with the last sample, not the first as DistributedSampler."""
    per_rank = -(-n_samples // world_size)
    padded = list(range(n_samples)) + [n_samples - 1] * (per_rank * world_size - n_samples)
    return padded[rank::world_size][worker_id::num_workers]


def shards_nothing(n_samples, rank, world_size, worker_id, num_workers):
    return range(n_samples)


def shards_one_past_the_end(n_samples, rank, world_size, worker_id, num_workers):
    readers = world_size * num_workers
    return list(range(rank + world_size * worker_id + 1, n_samples + 1, readers))


def shards_a_count(n_samples, rank, world_size, worker_id, num_workers):
    return len(solutions.shard_indices(n_samples, rank, world_size, worker_id, num_workers))


# --- serial_fraction, notebook 08 -----------------------------------------------------------------


def serial_by_amdahl_always(kind, n, step_time_1, step_time_n):
    """Weak scaling read as strong: the time ratio and Amdahl's law for both kinds."""
    return (n * step_time_n / step_time_1 - 1) / (n - 1)


def serial_by_amdahl_for_weak(kind, n, step_time_1, step_time_n):
    speedup = n * step_time_1 / step_time_n if kind == "weak" else step_time_1 / step_time_n
    return (n / speedup - 1) / (n - 1)


def serial_weak_time_ratio(kind, n, step_time_1, step_time_n):
    """Gustafson's law for weak scaling, but on t1 / tn: the factor n forgotten."""
    if kind == "strong":
        return solutions.serial_fraction(kind, n, step_time_1, step_time_n)
    return (n - step_time_1 / step_time_n) / (n - 1)


def serial_parallel_fraction(kind, n, step_time_1, step_time_n):
    return 1 - solutions.serial_fraction(kind, n, step_time_1, step_time_n)


def serial_clipped(kind, n, step_time_1, step_time_n):
    return min(1.0, max(0.0, solutions.serial_fraction(kind, n, step_time_1, step_time_n)))


def serial_speedup(kind, n, step_time_1, step_time_n):
    return step_time_1 / step_time_n * (n if kind == "weak" else 1)


# --- find_drifted, notebook 11 --------------------------------------------------------------------


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def drifted_exactly(model, atol=1e-6):
    """The reference's exchange, with == where a tolerance is needed."""
    mine = _flat(model)
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(not torch.equal(mine, reference))
    dist.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def drifted_by_checksum(model, atol=1e-6):
    """Every rank's sum, gathered and compared with rank 0's, with the tolerance."""
    sums = [None] * dist.get_world_size()
    dist.all_gather_object(sums, float(_flat(model).double().sum()))
    return [rank for rank, total in enumerate(sums) if abs(total - sums[0]) > atol]


def drifted_locally(model, atol=1e-6):
    """Each rank finds out about itself and keeps it to itself."""
    reference = _flat(model)
    dist.broadcast(reference, src=0)
    drifted = (_flat(model) - reference).abs().max() > atol
    return [dist.get_rank()] if drifted else []


def drifted_on_rank_0_only(model, atol=1e-6):
    result = solutions.find_drifted(model, atol)
    return result if dist.get_rank() == 0 else None


def drifted_from_the_mean(model, atol=1e-6):
    mine = _flat(model)
    mean = mine.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool((mine - mean).abs().max() > atol))
    return [rank for rank, flag in enumerate(flags) if flag]


def drifted_broadcast_in_place(model, atol=1e-6):
    """Broadcasts into the parameters themselves: the drift is repaired before it is seen."""
    before = _flat(model)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool((before - _flat(model)).abs().max() > atol))
    return [rank for rank, flag in enumerate(flags) if flag]


# --- merge_partials, notebook 14 ------------------------------------------------------------------


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_not_rescaled(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def merge_lse_by_max(out_a, lse_a, out_b, lse_b):
    """Weighs the outputs right, but keeps the larger lse: the next merge weighs wrong."""
    out, _ = solutions.merge_partials(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def merge_naive_exp(out_a, lse_a, out_b, lse_b):
    """Exponentiates the lses themselves: inf for scores above 709."""
    a, b = torch.exp(lse_a), torch.exp(lse_b)
    out = (a.unsqueeze(-1) * out_a + b.unsqueeze(-1) * out_b) / (a + b).unsqueeze(-1)
    return out, torch.log(a + b)


def merge_without_inf_guard(out_a, lse_a, out_b, lse_b):
    """Subtracts the maximum, but -inf - (-inf) is NaN on rows no key reached."""
    top = torch.maximum(lse_a, lse_b)
    a, b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    out = (a.unsqueeze(-1) * out_a + b.unsqueeze(-1) * out_b) / (a + b).unsqueeze(-1)
    return out, top + torch.log(a + b)


def merge_returns_out_only(out_a, lse_a, out_b, lse_b):
    return solutions.merge_partials(out_a, lse_a, out_b, lse_b)[0]


# --- tensor_parallel_pair, notebook 13 ------------------------------------------------------------


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Mean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x / dist.get_world_size()

    @staticmethod
    def backward(ctx, grad):
        return grad


def pair_all_reduce_both(x):
    """An all-reduce in both directions, for f and g alike."""
    return _AllReduceBoth.apply(x)


def pair_no_collective(x):
    return _Identity.apply(x)


def pair_mean(x):
    return _Mean.apply(x)


def pair_plain_all_reduce(x):
    """No autograd.Function: dist.all_reduce on a copy, which autograd cannot see through."""
    x = x.detach().clone()
    dist.all_reduce(x)
    return x


# --- expert_dispatch, notebook 16 -----------------------------------------------------------------


def _kept_sorted(experts, keep):
    flat = experts.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    return flat, kept, kept[torch.argsort(flat[kept], stable=True)]


def plan_send_per_expert(experts, keep, experts_per_rank, world):
    flat, kept, order = _kept_sorted(experts, keep)
    per_expert = torch.bincount(flat[kept], minlength=experts_per_rank * world)
    return order, per_expert, per_expert.tolist()  # one count per expert, not per rank


def plan_reversed_splits(experts, keep, experts_per_rank, world):
    order, per_expert, send = solutions.plan_dispatch(experts, keep, experts_per_rank, world)
    return order, per_expert, send[::-1]


def plan_unsorted(experts, keep, experts_per_rank, world):
    _, kept, _ = _kept_sorted(experts, keep)
    _, per_expert, send = solutions.plan_dispatch(experts, keep, experts_per_rank, world)
    return kept, per_expert, send  # token order: the blocks are not per rank


def plan_sorted_by_rank_only(experts, keep, experts_per_rank, world):
    flat, kept, _ = _kept_sorted(experts, keep)
    by_rank = kept[torch.argsort(-(flat[kept] % experts_per_rank), stable=True)]
    order = by_rank[torch.argsort(flat[by_rank] // experts_per_rank, stable=True)]
    _, per_expert, send = solutions.plan_dispatch(experts, keep, experts_per_rank, world)
    return order, per_expert, send


def plan_ignoring_capacity(experts, keep, experts_per_rank, world):
    return solutions.plan_dispatch(experts, torch.ones_like(keep), experts_per_rank, world)


def plan_without_minlength(experts, keep, experts_per_rank, world):
    flat, kept, order = _kept_sorted(experts, keep)
    per_expert = torch.bincount(flat[kept])
    send = [
        int(per_expert[r * experts_per_rank : (r + 1) * experts_per_rank].sum())
        for r in range(world)
    ]
    return order, per_expert, send


# --- gpipe_step, notebook 15 ----------------------------------------------------------------------


def _gpipe_variant(stage_module, micro_batches, targets, loss_fn, *, scale=1.0, zero=False):
    """The reference GPipe step, with one of a learner's plausible mistakes switched on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kept, sends = [], []
    for x, target in zip(micro_batches, targets):
        if rank > 0:
            x = torch.empty_like(x)
            dist.recv(x, src=rank - 1)
            x.requires_grad_(True)
        out = stage_module(x)
        if rank < world - 1:
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        else:
            out = loss_fn(out, target) * scale
        kept.append((x, out))
    for x, out in kept:
        if zero:
            stage_module.zero_grad()
        if rank < world - 1:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        else:
            out.backward()
        if rank > 0:
            sends.append(dist.isend(x.grad, dst=rank - 1))
    for work in sends:
        work.wait()


def gpipe_mean_of_micro_batch_losses(stage_module, micro_batches, targets, loss_fn):
    _gpipe_variant(stage_module, micro_batches, targets, loss_fn, scale=1 / len(micro_batches))


def gpipe_zero_grad_per_micro_batch(stage_module, micro_batches, targets, loss_fn):
    _gpipe_variant(stage_module, micro_batches, targets, loss_fn, zero=True)


def gpipe_whole_batch_at_once(stage_module, micro_batches, targets, loss_fn):
    solutions.gpipe_step(stage_module, [torch.cat(micro_batches)], [torch.cat(targets)], loss_fn)


def gpipe_input_without_grad(stage_module, micro_batches, targets, loss_fn):
    rank, world = dist.get_rank(), dist.get_world_size()
    kept = []
    for x, target in zip(micro_batches, targets):
        if rank > 0:
            x = torch.empty_like(x)
            dist.recv(x, src=rank - 1)
        out = stage_module(x)
        if rank < world - 1:
            dist.send(out.detach(), dst=rank + 1)
        else:
            out = loss_fn(out, target)
        kept.append((x, out))
    for x, out in kept:
        if rank < world - 1:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        else:
            out.backward()
        if rank > 0:
            dist.send(x.grad, dst=rank - 1)
