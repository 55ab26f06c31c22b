"""Pipeline parallelism by hand: a model cut into stages, one per rank, joined by send/recv.

Notebook 15 builds what ``torch.distributed.pipelining`` does and checks it against torch:

* :func:`split_stages` cuts an ``nn.Sequential`` into consecutive stages.
* :class:`HandStage` is one stage on its rank: its forward receives the activation from the
  stage before and sends its output to the stage after; its backward receives the gradient of
  its output from the stage after and sends the gradient of its input to the stage before.
* :mod:`.pipeline_orders` holds the orders the stages run (GPipe, 1F1B), their tick tables
  and the bubble's formula; its names are importable from here too.
* :func:`run_order` runs a stage's actions, timing each as an mgtutor phase;
  :class:`HeldMicroBatches` measures, while it runs, how many micro-batches' saved activations
  are really still alive; :func:`mgtutor.parallel.comms.record_comms` records the sends and
  receives that ran.

Stage ``s`` runs on global rank ``ranks[s]``: by default ``s``, the default process group's
ranks in order; inside a :class:`~.layout.Layout`, ``ranks=groups.pp_ranks``, this rank's
pipeline-parallel group. "Rank ``stage - 1``" below means the rank of stage ``stage - 1``.

Sends are ``dist.isend``: with blocking sends, 1F1B deadlocks (stage 0 sends an activation
while stage 1 sends a gradient, each waiting for the other to receive). A send is waited for
when the next one of its kind goes out, and at the end of :func:`run_order`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mgtutor.parallel.pipeline_orders import (
    Action,
    bubble_fraction,
    gpipe_order,
    max_in_flight,
    one_f_one_b_order,
    replay_ticks,
    tick_table,
)

# The orders' names are re-exported: notebook 15 reads them as ``pipeline.gpipe_order``.
__all__ = [
    "HandStage",
    "HeldMicroBatches",
    "bubble_fraction",
    "gpipe_order",
    "max_in_flight",
    "one_f_one_b_order",
    "replay_ticks",
    "run_order",
    "split_stages",
    "tick_table",
]


def split_stages(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``n_stages`` runs of consecutive layers (the first ones get any extra).

    The stages share the model's parameters (no copy); parameter names keep their index in
    ``model`` (``"2.weight"``), so a stage's gradients can be compared with the whole model's.

    Example:
        >>> split_stages(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), 2)[1]
        Sequential((2): Linear(...) (3): Linear(...))
    """
    if not 1 <= n_stages <= len(model):
        raise ValueError(f"cannot cut {len(model)} layers into {n_stages} stages")
    size, extra = divmod(len(model), n_stages)
    bounds = [i * size + min(i, extra) for i in range(n_stages + 1)]
    return [model[bounds[i] : bounds[i + 1]] for i in range(n_stages)]


class HandStage:
    """One pipeline stage on its rank, with the messages it exchanges made explicit.

    Args:
        module: this stage's layers.
        stage: its index; it runs on rank ``ranks[stage]`` and talks to the ranks of stages
            ``stage - 1`` and ``stage + 1``.
        n_stages: how many stages (= ranks) the pipeline has.
        shape: the shape of a micro-batch's activation between stages (every boundary alike).
        dtype: its dtype.
        loss_fn: ``loss_fn(output, target) -> scalar``, needed by the last stage.
        ranks: the global rank of each stage (``groups.pp_ranks`` of a layout); None for
            ``range(n_stages)``.

    Raises:
        ValueError: the last stage was given no ``loss_fn``; ``ranks`` is not ``n_stages``
            distinct ranks, or does not put this stage on this rank.

    Attributes:
        sent: one ``(kind, peer, nbytes)`` per message sent, kind ``"activation"`` or
            ``"gradient"``, peer the global rank it went to.
        losses: the last stage's loss per micro-batch, in the order computed.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        n_stages: int,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.module, self.stage, self.n_stages = module, stage, n_stages
        self.ranks = list(range(n_stages) if ranks is None else ranks)
        _check_ranks(self.ranks, stage, n_stages)
        self.shape, self.dtype, self.loss_fn = tuple(shape), dtype, loss_fn
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(
                f"stage {stage} is the last of {n_stages}: it computes the loss, so give it "
                "loss_fn(output, target)"
            )
        self.sent: list[tuple[str, int, int]] = []
        self.losses: list[torch.Tensor] = []
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch: (in, out)
        self._pending: dict[str, dist.Work] = {}  # the last send of each kind

    def receive(self, kind: str) -> torch.Tensor:
        """Receive one micro-batch's ``"activation"`` (from stage ``stage - 1``'s rank) or
        ``"gradient"`` (from stage ``stage + 1``'s), of ``shape``; sends nothing."""
        peer = self.stage - 1 if kind == "activation" else self.stage + 1
        tensor = torch.empty(self.shape, dtype=self.dtype)
        dist.recv(tensor, src=self.ranks[peer])
        return tensor

    def forward(
        self, i: int, x: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> None:
        """Forward micro-batch ``i``; keep its input and output until its backward.

        Receives: the activation from rank ``stage - 1`` (unless first, or ``x`` is given: the
        micro-batch itself on the first stage, an activation already received on the others).
        Sends: its output to rank ``stage + 1``, unless last (that computes the loss with
        ``target``).
        """
        if x is None:
            x = self.receive("activation")
        if not self.is_first:
            x.requires_grad_(True)
        out = self.module(x)
        if self.is_last:
            assert self.loss_fn is not None  # __init__ requires it of the last stage
            if target is None:
                raise ValueError(f"stage {self.stage} is the last: forward needs the target")
            out = self.loss_fn(out, target)
            self.losses.append(out.detach())
        else:
            self._send("activation", out.detach(), self.stage + 1)
        self._kept[i] = (x, out)

    def backward(self, i: int, grad: torch.Tensor | None = None) -> None:
        """Backward micro-batch ``i``, adding its gradients to the parameters' ``.grad``.

        Receives: the gradient of its output from rank ``stage + 1`` (unless last, which starts
        from its loss, or ``grad`` is given). Sends: the gradient of its input to rank
        ``stage - 1``, unless first.
        """
        x, out = self._kept.pop(i)
        if self.is_last:
            out.backward()
        else:
            out.backward(self.receive("gradient") if grad is None else grad)
        if not self.is_first:
            assert x.grad is not None  # forward made x require grad on every stage but the first
            self._send("gradient", x.grad, self.stage - 1)

    def in_flight(self) -> int:
        """How many micro-batches' activations this stage holds now (forwarded, not backward)."""
        return len(self._kept)

    def wait_sent(self, kind: str) -> None:
        """Wait until the last ``"activation"`` or ``"gradient"`` sent has been received."""
        if kind in self._pending:
            self._pending.pop(kind).wait()

    def wait(self) -> None:
        """Wait until every message sent so far has been received."""
        for work in self._pending.values():
            work.wait()
        self._pending.clear()

    def _send(self, kind: str, tensor: torch.Tensor, stage: int) -> None:
        # A pending send holds its tensor, and gloo marks it completed only once waited on:
        # wait for the previous send of this kind (received by now in GPipe and 1F1B, as in
        # torch's schedules), or every micro-batch's output would live until the step's end.
        self.wait_sent(kind)
        tensor = tensor.contiguous()
        peer = self.ranks[stage]  # the global rank of the stage it goes to
        work = dist.isend(tensor, dst=peer)
        assert work is not None  # isend gives None only to a rank outside the default group
        self._pending[kind] = work
        self.sent.append((kind, peer, tensor.numel() * tensor.element_size()))


def _check_ranks(ranks: list[int], stage: int, n_stages: int) -> None:
    """ValueError unless ``ranks`` names ``n_stages`` distinct ranks, this stage's this rank's."""
    if len(ranks) != n_stages or len(set(ranks)) != n_stages:
        raise ValueError(
            f"stage {stage}: ranks={ranks} must name {n_stages} distinct global ranks, one per "
            "stage (inside a Layout: ranks=groups.pp_ranks)"
        )
    if dist.is_initialized() and dist.get_rank() != ranks[stage]:
        raise ValueError(
            f"rank {dist.get_rank()} runs stage {stage}, but ranks={ranks} puts stage {stage} "
            f"on rank {ranks[stage]}: inside a Layout pass ranks=groups.pp_ranks and "
            "stage=groups.pp_rank"
        )


class HeldMicroBatches:
    """How many micro-batches' activations a stage really holds, measured, not taken on trust.

    Inside :meth:`saving` (one micro-batch's forward), autograd's saved-tensor hooks
    (``torch.autograd.graph.saved_tensors_hooks``) note every tensor saved for backward, by a
    weak reference to its storage; storages in ``skip`` (the parameters, the batch) are left
    out. :meth:`count` is how many micro-batches still have any such storage alive, whoever
    keeps it: autograd's graph, or a stage that forgot to let go.

    Args:
        skip: tensors whose storages are not activations (parameters, the input batch).

    Attributes:
        peak: the largest :meth:`count` so far.
    """

    def __init__(self, skip: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in skip}
        self._saved: dict[int, list[StorageWeakRef]] = {}
        self.peak = 0

    @contextlib.contextmanager
    def saving(self, i: int) -> Iterator[None]:
        """Note what autograd saves inside the block as micro-batch ``i``'s."""

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._skip:
                self._saved.setdefault(i, []).append(StorageWeakRef(storage))
            return t.detach()  # not t itself: an output saved as itself would make a cycle

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def count(self) -> int:
        """Micro-batches with a saved storage still alive now (and update :attr:`peak`)."""
        alive = sum(any(not ref.expired() for ref in refs) for refs in self._saved.values())
        self.peak = max(self.peak, alive)
        return alive


def _no_phase(name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def run_order(
    stage: HandStage,
    order: Sequence[Action],
    inputs: Sequence[torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    held: HeldMicroBatches | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[tuple[str, int, float, float]]:
    """Run ``order`` on ``stage``, then wait for its sends; time each action's compute.

    Waiting is timed apart from computing. Given ``phase=mgtutor.phase``, each action is also
    recorded as the phases "wait" (receiving this action's input, and the previous send of the
    kind it sends being received), "forward" and "backward", so that
    :func:`mgtutor.plot_timeline` draws the bubble as "wait". The first stage
    needs ``inputs`` and the last ``targets``, one per micro-batch. Sends and receives: those
    of :meth:`HandStage.forward` and :meth:`HandStage.backward` for each action. With ``held``,
    each forward's saved tensors are noted and the micro-batches held are counted after each
    action.

    Returns:
        One ``(kind, micro-batch, start, end)`` per action, ``perf_counter`` seconds of its
        compute alone.
    """
    if stage.is_first and inputs is None:
        raise ValueError(f"stage {stage.stage} is the first: give inputs, one per micro-batch")
    if stage.is_last and targets is None:
        raise ValueError(f"stage {stage.stage} is the last: give targets, one per micro-batch")
    # Bound once, past the checks above: a stage reads only the one it needs.
    first_inputs = inputs if inputs is not None else ()
    last_targets = targets if targets is not None else ()
    if phase is None:
        phase = _no_phase
    spans = []
    for kind, i in order:
        received = None
        with phase("wait"):
            if (kind == "F" and not stage.is_first) or (kind == "B" and not stage.is_last):
                received = stage.receive("activation" if kind == "F" else "gradient")
            stage.wait_sent("activation" if kind == "F" else "gradient")
        start = time.perf_counter()
        if kind == "F":
            noting = held.saving(i) if held is not None else contextlib.nullcontext()
            with phase("forward"), noting:
                x = first_inputs[i] if stage.is_first else received
                stage.forward(i, x, last_targets[i] if stage.is_last else None)
        else:
            with phase("backward"):
                stage.backward(i, received)
        spans.append((kind, i, start, time.perf_counter()))
        if held is not None:
            held.count()
    stage.wait()
    return spans
