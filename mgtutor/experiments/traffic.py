"""What a training step sends: every collective counted inside a rank, and torch's own pattern.

:func:`mgtutor.plan.planner.plan` writes down the ZeRO paper's communication per step. This
module checks it on CPU ranks and says where torch 2.14 does something else:

* :func:`mgtutor.parallel.comms.record_comms` writes down, inside a rank, every call that
  reaches a process group as a :class:`~mgtutor.parallel.comms.Comm` (kind, the group's size
  and name, bytes of the whole buffer); :func:`tally` groups them as the planner's
  :class:`~mgtutor.plan.planner.Collective`, with the bytes one GPU sends.
* :func:`build` makes the modules a :class:`~mgtutor.plan.shape.Transformer` describes
  (an embedding, then one :class:`mgtutor.parallel.tensor.Block` per layer), so the ranks run
  the very parameter count the planner plans.
* :func:`torch_collectives` is what torch runs for ZeRO 0 to 3 on that model, which differs
  from the paper's pattern: ``ZeroRedundancyOptimizer`` (ZeRO-1) keeps DDP's all-reduce and
  then broadcasts each parameter from the rank that updated it (``_sync_params`` in
  ``torch/distributed/optim/zero_redundancy_optimizer.py``): 1.5x the paper's bytes. FSDP2
  (``fully_shard`` per layer and on the root) pads each parameter's first dimension to a
  multiple of N, gathers each unit separately, and the root once per micro-batch, not twice
  (``reshard_after_forward=None``, the default, keeps the root's parameters for backward).
  With ``reshard_after_forward=False`` every unit is gathered once per micro-batch.
* :func:`count_steps` records a few steps of each strategy inside a rank; :func:`totals` sums
  collectives by name, to set torch's pattern beside the paper's.

How calls are counted (:mod:`mgtutor.parallel.comms`): a ``TorchDispatchMode`` sees every
``c10d`` operator, which every ``ProcessGroup`` call goes through, whoever makes it (DDP's
reducer from C++, FSDP2, ``ZeroRedundancyOptimizer``, the pipeline schedules, point-to-point
sends). Wrapping ``torch.distributed``'s Python functions misses the reducer and depends on
which of two names a library calls; Flight Recorder on gloo misses ``send`` and ``recv``.

The bytes a GPU sends per call follow the textbook ring on N ranks, the planner's formula
(:func:`mgtutor.ring.bytes_sent_on_ring`; the two can disagree on the calls and their buffers):
(N-1)/N of the buffer for an all-gather, a reduce-scatter, an all-to-all and a broadcast (on
average over the ranks: N-1 of them receive it once), 2(N-1)/N for an all-reduce, the whole
buffer for a send, nothing for a receive: what torch asks of the process group, and what NCCL's
ring sends. gloo differs below it: ProcessGroupGloo runs a reduce-scatter as an all-reduce of
the whole buffer, each rank then keeping its chunk (``reduce_scatter_tensor_coalesced``; Flight
Recorder names the call ``gloo:all_reduce``), so on CPU ranks FSDP's reduce-scatters send
twice the ring's bytes: :func:`bytes_written` sees it.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from mgtutor.measure.written import SocketWrites, bytes_written
from mgtutor.parallel.comms import Comm, record_comms
from mgtutor.parallel.tensor import Block
from mgtutor.plan.planner import Collective
from mgtutor.plan.shape import Transformer
from mgtutor.ring import RING_PASSES, bytes_sent_on_ring

__all__ = [
    "SocketWrites",
    "build",
    "bytes_written",
    "count_steps",
    "tally",
    "torch_collectives",
    "totals",
]


def _sent(name: str, size: int, nbytes: int) -> int:
    """The planner's bytes sent: the ring's share of the buffer, a send's tensor."""
    if name == "send":
        return nbytes
    return bytes_sent_on_ring(name, size, nbytes) if name in RING_PASSES else 0


def _sorted(collectives: list[Collective]) -> tuple[Collective, ...]:
    return tuple(sorted(collectives, key=lambda c: (c.group, c.name, -c.buffer_bytes, c.size)))


def tally(calls: Iterable[Comm], group: str = "dp") -> tuple[Collective, ...]:
    """Calls grouped by kind, group size and buffer, as the planner's collectives of ``group``.

    Receives are left out: the planner counts what a GPU sends, on the textbook ring from the
    buffer (:func:`mgtutor.ring.bytes_sent_on_ring`), whatever the splits of an all-to-all
    (:attr:`Comm.sent` counts an all-to-all's real slices). ``group`` is the caller's label: it is
    not compared with the calls' :attr:`Comm.group`.

    Raises:
        ValueError: the calls ran on more than one process group: ``group`` would label them
            all; tally each group's calls apart.
    """
    calls = [c for c in calls if c.op != "recv"]
    ran_on = sorted({c.group for c in calls})
    if len(ran_on) > 1:
        raise ValueError(
            f"tally: these calls ran on {len(ran_on)} process groups ({', '.join(ran_on)}), and "
            f"would all be labelled {group!r}; tally each group's calls apart (Comm.group)"
        )
    counted = Counter((c.op, c.group_size, c.buffer) for c in calls)
    return _sorted(
        [
            Collective(name, group, size, nbytes, n, n * _sent(name, size, nbytes))
            for (name, size, nbytes), n in counted.items()
        ]
    )


def totals(collectives: Iterable[Collective]) -> dict[str, tuple[int, int, int]]:
    """By name: (calls, bytes of all their buffers, bytes one GPU sends), summed."""
    out: dict[str, tuple[int, int, int]] = {}
    for c in collectives:
        calls, buffers, sent = out.get(c.name, (0, 0, 0))
        out[c.name] = (calls + c.calls, buffers + c.calls * c.buffer_bytes, sent + c.sent_bytes)
    return out


def _require_shapes(model: Transformer) -> None:
    if model.params is not None:
        raise ValueError("a Transformer given by params= has no layer shapes to build")


def build(model: Transformer) -> nn.Sequential:
    """The modules ``model`` describes: ``Embedding(vocab, hidden)`` (if any), then its layers.

    Each layer is a :class:`mgtutor.parallel.tensor.Block`, whose parameters are the
    planner's per-layer count; the embedding is the planner's tied V·h (no output layer).
    The input is token ids of shape (micro_batch, seq_len), or activations of shape
    (micro_batch, seq_len, hidden) without an embedding.

    Raises:
        ValueError: for a model given by its parameter count (``params``): its layers' shapes
            are unknown.
    """
    _require_shapes(model)
    ffn = model.ffn or 4 * model.hidden
    layers = [Block(model.hidden, model.heads, ffn) for _ in range(model.layers)]
    head = [nn.Embedding(model.vocab, model.hidden)] if model.vocab else []
    return nn.Sequential(*head, *layers)


def _units(model: Transformer) -> list[tuple[bool, list[torch.Size]]]:
    """Per FSDP unit, whether it is the root, and its parameters' shapes (no tensor made)."""
    _require_shapes(model)
    with torch.device("meta"):
        block = Block(model.hidden, model.heads, model.ffn or 4 * model.hidden)
    layers = [(False, [p.shape for p in block.parameters()])] * model.layers
    if not model.vocab:  # the root owns no parameters: FSDP2 has nothing to gather for it
        return layers
    return [(True, [torch.Size((model.vocab, model.hidden))]), *layers]


def _padded(shape: torch.Size, n: int) -> int:
    """FSDP2's elements of a parameter: its first dimension rounded up to a multiple of N."""
    return math.ceil(shape[0] / n) * n * math.prod(shape[1:])


def torch_collectives(
    model: Transformer, dp: int, zero: int, *, micro_batches: int = 1
) -> tuple[Collective, ...]:
    """The data-parallel collectives torch 2.14 runs in one optimizer step, in float32.

    What :func:`count_steps` runs for each stage, on :func:`build`'s modules:

    * ZeRO 0 (``"ddp"``): DDP all-reduces the gradients once per step (micro-batches but the
      last inside ``no_sync``), in one call for a small model: DDP's buckets (a first one of
      1 MiB, then 25 MiB) split a larger one's bytes over more calls.
    * ZeRO 1 (``"zero1"``): the same, then ``ZeroRedundancyOptimizer`` broadcasts every
      parameter tensor from the rank that updated it (``parameters_as_bucket_view=False``).
    * ZeRO 3 (``"zero3"``): ``fully_shard`` on each layer and on the root, which holds the
      embedding; per micro-batch each layer is all-gathered twice, the root once, and each
      unit's gradients are reduce-scattered; every parameter's first dimension is padded to
      a multiple of N.
    * ZeRO 2 (``"zero2"``): as ZeRO 3 with ``reshard_after_forward=False``: one all-gather.

    Args:
        model: the shape, as :func:`build` makes it.
        dp: the number of data-parallel ranks (N).
        zero: 0 to 3, as above.
        micro_batches: backward passes per optimizer step (FSDP2 syncs after each).

    Returns:
        The collectives of group "dp", in :func:`tally`'s order, so the two compare with ``==``.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage, 0 to 3, got {zero!r}")
    units = _units(model)
    counted: Counter[tuple[str, int]] = Counter()
    if zero <= 1:
        shapes = [shape for _, unit in units for shape in unit]
        counted["all_reduce", sum(math.prod(shape) for shape in shapes) * 4] = 1
        if zero == 1:
            counted.update(("broadcast", math.prod(shape) * 4) for shape in shapes)
    else:
        for root, unit in units:
            nbytes = sum(_padded(shape, dp) for shape in unit) * 4
            gathers = 1 if root or zero == 2 else 2
            counted["all_gather", nbytes] += gathers * micro_batches
            counted["reduce_scatter", nbytes] += micro_batches
    return _sorted(
        [
            Collective(name, "dp", dp, nbytes, n, n * _sent(name, dp, nbytes))
            for (name, nbytes), n in counted.items()
        ]
    )


def _inputs(model: Transformer, batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if model.vocab:
        return torch.randint(0, model.vocab, (batch, model.seq_len), generator=gen)
    return torch.randn(batch, model.seq_len, model.hidden, generator=gen)


def count_steps(
    strategy: str, model: Transformer, *, steps: int = 3, micro_batches: int = 1
) -> list[list[Comm]]:
    """Inside a rank: train :func:`build`'s model a few steps and record each step's calls.

    The model stays on the CPU (gloo ranks); every rank of the default process group takes
    part (2 ranks for ``"pp"``). Each step is ``micro_batches`` forward and backward passes of
    ``model.micro_batch`` sequences (a loss of ``output.pow(2).mean()``), then Adam's step.

    Example:
        >>> tally(count_steps("zero1", Transformer(2, 8, 2, 4, vocab=11))[-1])  # inside a rank

    Args:
        strategy: ``"ddp"``; ``"zero1"`` (DDP and ``ZeroRedundancyOptimizer``); ``"zero2"`` /
            ``"zero3"`` (FSDP2's ``fully_shard`` on each layer and on the root, with
            ``reshard_after_forward`` False / True); ``"pp"`` (two stages, the first with the
            first half of the modules, run by torch's ``Schedule1F1B``).
        model: the shape to build.
        steps: optimizer steps, each recorded apart (the first ones may differ: DDP rebuilds
            its buckets before the second forward, a pipeline stage exchanges shapes first).
        micro_batches: passes per step.

    Returns:
        Per step, the calls this rank made (:func:`mgtutor.parallel.comms.record_comms`).
    """
    import torch.distributed as dist

    torch.manual_seed(0)
    modules = build(model)
    rank = dist.get_rank()
    if strategy == "pp":
        return _pipeline_steps(modules, model, rank, steps, micro_batches)
    from torch.nn.parallel import DistributedDataParallel as DDP

    net: nn.Module
    if strategy in ("ddp", "zero1"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = DDP(modules)
        opt = (
            ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam)
            if strategy == "zero1"
            else torch.optim.Adam(net.parameters())
        )
    elif strategy in ("zero2", "zero3"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (m for m in modules if isinstance(m, Block)):
            fully_shard(layer, mesh=mesh, reshard_after_forward=strategy == "zero3")
        fully_shard(modules, mesh=mesh)  # in place: it returns modules itself
        net = modules
        opt = torch.optim.Adam(net.parameters())
    else:
        raise ValueError(f"unknown strategy {strategy!r}: ddp, zero1, zero2, zero3 or pp")
    recorded = []
    for step in range(steps):
        with record_comms() as calls:
            for i in range(micro_batches):
                # DDP (ddp, zero1) all-reduces only at the last micro-batch; FSDP2 after each.
                last = i == micro_batches - 1
                with (
                    net.no_sync() if isinstance(net, DDP) and not last else contextlib.nullcontext()
                ):
                    x = _inputs(model, model.micro_batch, seed=1000 * step + 10 * i + rank)
                    net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        recorded.append(calls)
    return recorded


def _pipeline_steps(
    modules: nn.Sequential, model: Transformer, rank: int, steps: int, micro_batches: int
) -> list[list[Comm]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from mgtutor.parallel.pipeline import split_stages

    part = split_stages(modules, 2)[rank]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=lambda out, _: out.pow(2).mean())
    opt = torch.optim.Adam(part.parameters())
    batch = micro_batches * model.micro_batch
    recorded = []
    for step in range(steps):
        with record_comms() as calls:
            if rank == 0:
                schedule.step(_inputs(model, batch, seed=step))
            else:
                schedule.step(target=torch.zeros(batch, model.seq_len, model.hidden))
            opt.step()
            opt.zero_grad()
        recorded.append(calls)
    return recorded
