"""One record of communication: every collective and point-to-point call a rank runs.

:func:`record_comms` is a ``TorchDispatchMode``: it sees, at torch's dispatcher, each operator
that reaches a process group, whoever calls it (``torch.distributed``'s ``c10d.*`` operators,
DDP's reducer from C++, FSDP2, sends and receives, DTensor's functional collectives
``_c10d_functional.*``), in forward and in autograd's backward, and writes each down as a
:class:`Comm`. An operator on DTensors is handed to DTensor first, as torch's ``CommDebugMode``
does, so the collectives it runs on the local tensors to redistribute its inputs are seen one
by one. A dispatch mode holds for the thread that enters it, and autograd carries it to the
threads that run backward (torch's ``ThreadLocalState``). It is one way to count, not to time:
every tensor operation of the block passes through Python.

Bytes, per call, on the rank that ran it:

* ``buffer``: the whole buffer, the planner's convention (an all-reduce's or a broadcast's
  tensor, an all-gather's output, a reduce-scatter's input, an all-to-all's larger side, a send's
  or a receive's tensor).
* ``sent`` and ``received``: what leaves this rank and what arrives from the others. An
  all-to-all sends every slice of its input but its own (``sent_to`` lists the bytes for each
  rank of the group, its own slice included) and receives every slice of its output but its
  own; an all-gather sends its input to each of the other N-1 ranks and receives theirs; a send
  sends its tensor, a receive receives it. An all-reduce, a reduce-scatter and a broadcast
  count the textbook ring's share (:func:`mgtutor.ring.bytes_sent_on_ring`, the planner's
  formula), not what this rank's library did: (N-1)/N of the buffer each way, twice for an
  all-reduce; a broadcast's (N-1)/N is the average over the ranks (on a ring the root sends the
  whole buffer and the last rank none). Operators the planner has no formula for (a barrier,
  ``reduce_``, ``gather_``, ``scatter_``) count no bytes, though a reduce, a gather or a
  scatter moves some.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mgtutor.ring import RING_PASSES, bytes_sent_on_ring

__all__ = [
    "Comm",
    "CommRecorder",
    "by_kind",
    "comm_counts",
    "in_backward",
    "kind_of",
    "record_comms",
    "record_ops",
]


@dataclass(frozen=True)
class Comm:
    """One call a rank made to a process group, as torch's dispatcher ran it.

    Example:
        >>> Comm("all_reduce", "c10d.allreduce_", "1", 2, 4000, 4000, 4000, "backward")
    """

    op: str  # the kind: "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", ...
    operator: str  # torch's operator, "namespace.name": "c10d.allreduce_"
    group: str  # the process group's ``group_name`` ("" where a torch cannot tell it)
    group_size: int  # the group's number of ranks, N
    buffer: int  # bytes of the whole buffer (see the module)
    sent: int  # bytes that leave this rank (a ring collective: the ring's share; see the module)
    received: int  # bytes that arrive from other ranks (likewise)
    # "backward" while autograd's engine runs a backward pass, hooks included, else "forward":
    # calls made between passes (a pipeline schedule's gradient sends, made after backward()
    # returns; an all-reduce of gradients after it) are "forward".
    phase: str
    sent_to: tuple[int, ...] = ()  # an all-to-all's bytes to each rank of the group, own included
    received_from: tuple[int, ...] = ()  # an all-to-all's bytes from each rank, own included
    peer: int | None = None  # a send's destination or a receive's source, global (None: any)


_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def kind_of(operator: str) -> str:
    """The kind of a torch operator, ``"namespace.name"`` or ``"name"``.

    ``"c10d.allreduce_"`` and ``"c10d_functional.all_reduce"`` are both ``"all_reduce"``; an
    operator of no kind listed in :class:`Comm` keeps its own name (``"barrier"``).
    """
    name = operator.rsplit(".", 1)[-1]
    for short, long in (("allreduce", "all_reduce"), ("allgather", "all_gather")):
        name = name.replace(short, long)
    name = name.replace("alltoall", "all_to_all").strip("_")
    return next((k for k in _KINDS if name.startswith(k)), name)


def by_kind(counted: Iterable[Any] | Mapping[Any, int]) -> dict[str, int]:
    """Calls counted by kind (``{"all_reduce": 2, ...}``).

    Accepts records (anything with an ``op``, as :class:`Comm`) or counts by operator, as
    :func:`comm_counts` and torch's ``CommDebugMode().get_comm_counts()`` give them, so the two
    compare.
    """
    if isinstance(counted, Mapping):
        out: Counter[str] = Counter()
        for operator, n in counted.items():
            out[kind_of(str(operator))] += n
        return dict(out)
    return dict(Counter(c.op for c in counted))


def comm_counts(comms: Iterable[Comm]) -> dict[str, int]:
    """Calls by operator name (``{"c10d.allreduce_": 2}``). torch's ``CommDebugMode`` keys its
    counts by operator object and counts no send, receive or barrier: compare the two with
    :func:`by_kind`."""
    return dict(Counter(c.operator for c in comms))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The process group an operator runs on: a c10d operator's argument, a functional one's
    ``group_name`` resolved; None where it cannot be told."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # a ReduceOp, the other script object c10d operators take
                continue
    names = [a.name for a in func._schema.arguments]
    if "group_name" not in names:
        return None
    index = names.index("group_name")
    name = args[index] if index < len(args) else kwargs.get("group_name")
    # torch._C's resolver is what the functional operators themselves call (read in 2.14.1).
    resolve = getattr(torch._C._distributed_c10d, "_resolve_process_group", None)
    if resolve is None:  # rather than count the call on the default group's size
        raise RuntimeError(
            f"record_comms: torch {torch.__version__} has no "
            "torch._C._distributed_c10d._resolve_process_group, so the group of "
            f"{func} cannot be told; record outside DTensor or use a newer torch"
        )
    return resolve(name)


def in_backward() -> bool | None:
    """Whether autograd's engine runs a backward pass on this thread (its nodes and the hooks and
    final callbacks it calls, as FSDP2's gradient reduce-scatters); None on a torch without the
    private ``torch._C._current_graph_task_id`` (-1 outside a backward in 2.14.1, whose
    ``utils/checkpoint.py`` reads it too)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return None if task_id is None else task_id() != -1


def _phase() -> str:
    """``"backward"`` or ``"forward"`` by :func:`in_backward`; ``"unknown"`` if it cannot say."""
    now = in_backward()
    return "unknown" if now is None else ("backward" if now else "forward")


def _slices(tensors: Any, splits: Any, size: int) -> tuple[int, ...]:
    """Bytes per rank of an all-to-all side: a list of tensors, or one tensor cut by ``splits``
    along dim 0 (equal slices where ``splits`` is empty)."""
    if isinstance(tensors, (list, tuple)):
        return tuple(t.nbytes for t in tensors)
    rows = tensors.shape[0] if tensors.dim() else 1
    row = tensors.nbytes // max(rows, 1)
    counts = list(splits) if splits else [rows // size] * size
    return tuple(n * row for n in counts)


def _all_to_all(operator: str, args: tuple[Any, ...], out: Any, size: int) -> tuple[Any, ...]:
    """(bytes to each rank, bytes from each rank) of an all-to-all operator."""
    if operator.startswith("c10d."):  # (output, input, group, output_splits, input_splits, ...)
        splits = (args[3], args[4]) if operator == "c10d.alltoall_base_" else ((), ())
        return _slices(args[1], splits[1], size), _slices(args[0], splits[0], size)
    # functional: (input, output_split_sizes, input_split_sizes, group_name) -> output
    return _slices(args[0], args[2], size), _slices(out, args[1], size)


def _operator(func: Any) -> str:
    """An operator's "namespace.name" ("c10d.send", "aten.bmm"), from its public packet."""
    return str(func.overloadpacket)


def _describe(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Comm | None:
    """The :class:`Comm` of one operator that ran, or None if it is no communication."""
    operator = _operator(func)
    namespace = operator.partition(".")[0]
    if namespace not in _NAMESPACES:
        return None
    op = kind_of(operator)
    if namespace != "c10d" and op not in _KINDS:  # wait_tensor, wrap_tensor_autograd: no traffic
        return None
    group = _group(func, args, kwargs)
    size = group.size() if group is not None else dist.get_world_size()
    rank = group.rank() if group is not None else dist.get_rank()
    label = getattr(group, "group_name", "")  # "" where a torch lacks the property
    buffer = max((_nbytes(v) for v in (*args, *kwargs.values(), out)), default=0)
    sent_to: tuple[int, ...] = ()
    received_from: tuple[int, ...] = ()
    if op == "all_to_all":
        sent_to, received_from = _all_to_all(operator, args, out, size)
        sent, received = sum(sent_to) - sent_to[rank], sum(received_from) - received_from[rank]
    elif op == "all_gather":
        sent = received = buffer // size * (size - 1)
    elif op == "send":
        sent, received = _nbytes(args[0]), 0
    elif op == "recv":
        sent, received = 0, _nbytes(args[0])
    elif op in RING_PASSES:
        sent = received = bytes_sent_on_ring(op, size, buffer)
    else:
        sent = received = 0
    peer = None
    if operator in ("c10d.send", "c10d.recv_") and group is not None:
        # (tensors, group, the peer's rank in the group, tag): the rank the message went to or
        # came from, which a wrong pipeline wiring changes though no byte count does
        peer = dist.get_global_rank(group, args[2])
    return Comm(
        op, operator, label, size, buffer, sent, received, _phase(), sent_to, received_from, peer
    )


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without the public DTensor (before 2.5)
        return None
    return DTensor


_DTENSOR = _dtensor_type()


class CommRecorder(TorchDispatchMode):
    """The dispatch mode behind :func:`record_comms`; ``comms`` lists the calls in order."""

    def __init__(self, comms: list[Comm] | None = None) -> None:
        super().__init__()
        self.comms: list[Comm] = [] if comms is None else comms

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if _DTENSOR is not None and _DTENSOR in types:
            # Let DTensor run first: an operator on DTensors redistributes its inputs with
            # collectives on the local tensors, which come back here. Calling func instead
            # would run them where this mode cannot see them.
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        comm = _describe(func, args, kwargs, out)
        if comm is not None:
            self.comms.append(comm)
        return out


@contextlib.contextmanager
def record_comms() -> Iterator[list[Comm]]:
    """Inside a rank: every call to a process group made while the block runs, in order.

    Example:
        >>> with record_comms() as comms:
        ...     model(x).sum().backward()
        >>> [(c.op, c.phase, c.sent) for c in comms]  # [("all_reduce", "forward", 96), ...]
    """
    comms: list[Comm] = []
    with CommRecorder(comms):
        yield comms


class _OpOrder(TorchDispatchMode):
    """The dispatch mode behind :func:`record_ops`."""

    def __init__(self, names: tuple[str, ...], ops: list[str]) -> None:
        super().__init__()
        self.names, self.ops = names, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if _DTENSOR is not None and _DTENSOR in types:
            return NotImplemented  # DTensor first, as in CommRecorder: its local operators
        name = _operator(func)
        if name in self.names:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _operator_exists(name: str) -> bool:
    namespace, _, op = name.partition(".")
    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return False
    return bool(op)


@contextlib.contextmanager
def record_ops(*names: str) -> Iterator[list[str]]:
    """Inside a rank: which of the operators ``names`` ran while the block runs, in order.

    Names are torch's "namespace.name", as :attr:`Comm.operator` writes them. It tells the order
    of work, which byte counts cannot: whether a send was posted before the matrix products it
    should overlap with. Not when it was waited for: ``Work.wait()`` is no operator. A dispatch
    mode sees operators after torch decomposes the composite ones: ``aten.matmul`` and
    ``aten.linear`` arrive as ``aten.mm``, ``aten.bmm`` or ``aten.addmm``, and are never seen.

    Raises:
        ValueError: a name torch has no operator for (a misspelling).

    Example (inside a rank, with a ring attention's inputs)::

        with record_ops("c10d.send", "aten.bmm") as ops:
            out = context.ring_attention(q, k, v, layout)
        ops[:3]  # ["c10d.send", "aten.bmm", "aten.bmm"]: the block leaves, then the work
    """
    unknown = [name for name in names if not _operator_exists(name)]
    if unknown:
        raise ValueError(
            f"record_ops: torch has no operator {', '.join(map(repr, unknown))}: name them as "
            '"namespace.name", e.g. "aten.bmm" or "c10d.send"'
        )
    ops: list[str] = []
    with _OpOrder(names, ops):
        yield ops
