"""The collectives of tensor and sequence parallelism, as autograd functions, and their counter.

A layer split across ranks must communicate where its forward needs what other ranks hold,
and autograd must communicate the conjugate collective in backward. Megatron-LM (Shoeybi et al.,
"Megatron-LM", arXiv:1909.08053, section 3) names the pair of plain tensor parallelism f and g;
sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, section 4.2.2) replaces them with an all-gather and a
reduce-scatter along the sequence:

=====================================  ==============================  ==========================
function                               forward                         backward
=====================================  ==============================  ==========================
:func:`copy_to_parallel` (f)           identity                        all-reduce
:func:`reduce_from_parallel` (g)       all-reduce                      identity
:func:`gather_from_sequence`           all-gather along the sequence   reduce-scatter along it
:func:`reduce_scatter_to_sequence`     reduce-scatter along it         all-gather along it
=====================================  ==============================  ==========================

Each collective runs on the process group passed as ``group`` (None: the default group, the
tensor-parallel group of a run that is tensor parallel only: see :mod:`.layout` for the groups
of a run that combines it with data parallelism) and, inside :func:`count_collectives`, is
written down with its phase and the bytes of its whole buffer (an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input), the convention of notebook 12. That list is
what the functions say they ran; :class:`CollectiveCounter` records what ran, at the
dispatcher. The all-gather and reduce-scatter are ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (torch 2.14 deprecates the older names,
``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which are used where the new ones do
not exist, as in 2.4); gloo runs both on CPU (measured with 2.4.1 and 2.14.1). They work along
dim 0, so another dim is moved to the front.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mgtutor.parallel._tally import Tally


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without the public DTensor (before 2.5)
        return None
    return DTensor


_DTENSOR = _dtensor_type()

#: A process group, or None for the default group (what ``torch.distributed`` takes).
Group = dist.ProcessGroup | None

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "Collective",
    "CollectiveCounter",
    "all_gather_along",
    "by_kind",
    "copy_to_parallel",
    "count_collectives",
    "gather_from_sequence",
    "record_collective",
    "reduce_from_parallel",
    "reduce_scatter_along",
    "reduce_scatter_to_sequence",
]


@dataclass(frozen=True)
class Collective:
    """One collective a rank ran: its name, in which pass, and the bytes of its whole buffer."""

    name: str  # "all_reduce", "all_gather" or "reduce_scatter"
    phase: str  # "backward" inside autograd's backward, else "forward"
    nbytes: int


_TALLY = Tally()


def count_collectives() -> contextlib.AbstractContextManager[list[Collective]]:
    """Write down every collective the functions of this module run inside the block.

    Example:
        >>> with count_collectives() as calls:
        ...     model(x).sum().backward()
        >>> [(c.name, c.phase) for c in calls]  # [("all_reduce", "forward"), ...]
    """
    return _TALLY.count()


def by_kind(counts: Mapping[Any, int] | list[Collective]) -> dict[str, int]:
    """Collectives counted by kind, "all_reduce", "all_gather" or "reduce_scatter".

    Accepts what :func:`count_collectives` wrote down, or torch's
    ``CommDebugMode().get_comm_counts()``, whose keys are operators (``c10d.allreduce_`` for
    ``dist.all_reduce``, ``c10d_functional.all_reduce`` for DTensor's), so the two can be
    compared.
    """
    if isinstance(counts, list):
        return dict(Counter(c.name for c in counts))
    out: Counter[str] = Counter()
    for op, n in counts.items():
        name = str(op).replace("allreduce", "all_reduce").replace("allgather", "all_gather")
        kind = next((k for k in ("all_reduce", "all_gather", "reduce_scatter") if k in name), name)
        out[kind] += n
    return dict(out)


_COLLECTIVE_NAMESPACES = (
    "c10d",
    "_c10d_functional",
    "c10d_functional",
    "_c10d_functional_autograd",
)
_COLLECTIVE_WORDS = (
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "alltoall",
    "all_to_all",
)


class CollectiveCounter(TorchDispatchMode):
    """Record the collective operators run inside the block: torch's ``CommDebugMode``, by hand.

    Each operator is seen at the dispatcher when it runs, so what it records is what ran, not
    what the calling code says it ran. ``calls`` lists them in order as :class:`Collective`
    records: the kind, the phase (``"backward"`` while autograd's engine is running a node,
    ``torch._C._current_autograd_node()``), and the bytes of the largest tensor among the
    operator's inputs and outputs (an all-reduce's tensor, an all-gather's output, a
    reduce-scatter's input: the whole buffer). An operator on DTensors is handed to DTensor
    first (as ``CommDebugMode`` does), so the collectives it runs to redistribute its inputs
    are seen one by one. ``get_comm_counts()`` returns
    ``{"namespace.operator": calls}``, which :func:`by_kind` reads as it reads
    ``CommDebugMode().get_comm_counts()``: DTensor's collectives (``_c10d_functional.*``, run on
    the local tensors) and ``torch.distributed``'s (``c10d.*``) alike.

    For torch 2.11 to 2.13, whose ``CommDebugMode`` raises IndexError in
    ``_fw_set_module_hook`` when a module runs twice in one forward, as ``tensor.Block``'s
    dropout does: each run adds a forward hook that pops the module's parent, so the second
    run pops twice (torch 2.14's ``debug/_comm_mode.py`` removes the earlier hook first).

    Example:
        >>> with CollectiveCounter() as counter:
        ...     model(x).sum().backward()
        >>> [(c.name, c.phase, c.nbytes) for c in counter.calls]
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTENSOR is not None and _DTENSOR in types:
            # Let DTensor run first: an operator on DTensors redistributes its inputs (a Partial
            # gradient read by an optimizer's step) with collectives on the local tensors, which
            # come back here. Calling func instead would run them where this mode cannot see.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "_opname", "")
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES and any(
            word in name for word in _COLLECTIVE_WORDS
        ):
            self.counts[f"{func.namespace}.{name}"] += 1
            tensors = [
                t for t in _flatten((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)
            ]
            phase = _phase()
            kind = by_kind({name: 1}).popitem()[0]
            self.calls.append(Collective(kind, phase, max((t.nbytes for t in tensors), default=0)))
        return out

    def get_comm_counts(self) -> dict[str, int]:
        """Calls so far, by operator, as ``CommDebugMode.get_comm_counts`` gives them."""
        return dict(self.counts)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return _flatten(list(value.values()))
    return [value]


def _phase() -> str:
    """The pass a collective runs in: ``"backward"`` while autograd's engine runs a node.

    ``"forward"`` otherwise, and ``"unknown"`` on a torch without the private
    ``torch._C._current_autograd_node`` (2.4 to 2.15 have it).
    """
    current_node = getattr(torch._C, "_current_autograd_node", None)
    if current_node is None:
        return "unknown"
    return "forward" if current_node() is None else "backward"


def record_collective(name: str, phase: str, nbytes: int) -> None:
    """Add one collective to what :func:`count_collectives` is counting (if anything is)."""
    _TALLY.write(Collective(name, phase, nbytes))


def _all_reduce(tensor: torch.Tensor, phase: str, group: Group = None) -> torch.Tensor:
    # A copy: autograd may hand the same gradient tensor to both branches of a residual.
    out = tensor.contiguous().clone()
    record_collective("all_reduce", phase, out.nbytes)
    dist.all_reduce(out, group=group)
    return out


def all_gather_along(
    tensor: torch.Tensor, dim: int, phase: str, group: Group = None
) -> torch.Tensor:
    """Every rank's ``tensor`` joined along ``dim``, recorded as an all_gather of ``phase``."""
    front = tensor.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * dist.get_world_size(group), *front.shape[1:]))
    record_collective("all_gather", phase, out.nbytes)
    _ALL_GATHER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy, which the next layer may keep


def reduce_scatter_along(
    tensor: torch.Tensor, dim: int, phase: str, group: Group = None
) -> torch.Tensor:
    """This rank's slice along ``dim`` of the ranks' summed ``tensor`` (a reduce_scatter)."""
    world = dist.get_world_size(group)
    if tensor.shape[dim] % world:
        raise ValueError(
            f"rank {dist.get_rank()}: cannot reduce-scatter dim {dim} of size "
            f"{tensor.shape[dim]} over {world} ranks; make the sequence a multiple of {world}"
        )
    front = tensor.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    record_collective("reduce_scatter", phase, front.nbytes)
    _REDUCE_SCATTER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy, which the next layer may keep


class _CopyToParallel(torch.autograd.Function):
    """Copy in forward, all-reduce in backward: the f of Megatron-LM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, "backward", ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce in forward, copy in backward: the g of Megatron-LM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, "forward", group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence in forward, reduce-scatter along it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, "forward", group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along(grad, ctx.dim, "backward", ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather along it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, "forward", group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, "backward", ctx.group), None, None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` unchanged forward; its gradient all-reduced backward.

    Every rank's part of the layer uses the whole ``x``, so ``x``'s gradient is the sum of each
    rank's contribution (Megatron-LM's f). ``group``: the tensor-parallel ranks (None: all).
    """
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Leave a tensor-parallel region: partial sums all-reduced forward; gradient copied backward.

    Megatron-LM's g: each rank's row-parallel product is a partial sum of the output.
    ``group``: the tensor-parallel ranks (None: all).
    """
    return _ReduceFromParallel.apply(x, group)


def gather_from_sequence(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Sequence shards to the whole sequence: all-gather forward, reduce-scatter backward."""
    return _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Partial sums to summed sequence shards: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterToSequence.apply(x, dim, group)
