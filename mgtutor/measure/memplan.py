"""Where a rank's memory goes: measured by category, computed ahead, and drawn per rank.

Three functions, one record:

* :func:`breakdown`, called inside a rank, counts the bytes of the tensors a training step
  keeps: parameters (and buffers), gradients, optimizer state and DDP's communication buckets.
  Each storage is counted once, so a gradient that is a view into a DDP bucket
  (``gradient_as_bucket_view=True``) or a parameter that is a view into a flat shard is not
  counted twice; a sharded parameter (a DTensor, as FSDP2's ``fully_shard`` makes) counts by the
  shard this rank holds, padding included.
* :func:`estimate` computes the same categories per rank before anything runs, for DDP,
  ZeRO-1 (DDP plus ``ZeroRedundancyOptimizer``), FSDP (``fully_shard``) and tensor parallelism
  (``parallelize_module``), following what torch 2.14 does (see its docstring for each rule
  and what it leaves out).
* :func:`plot_breakdown` draws one stacked bar per rank.

Activations and peaks come from the allocator, not from the tensors: on a GPU rank
``torch.cuda.max_memory_allocated`` minus the tensors counted gives what else was alive at the
peak (activations and temporaries); on a CPU rank only the process's peak resident memory is
known, which also holds the interpreter and torch's libraries (several hundred MiB), so the
activations are left unknown (None) there.

:func:`track` and :func:`tracked_breakdown` let a worker's fn name its model and optimizer so
that the breakdown can be taken when fn returns.

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from mgtutor.measure.memory import format_bytes, peak_rss

if TYPE_CHECKING:
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from torch import nn

__all__ = [
    "CATEGORIES",
    "OPTIMIZER_STATE_PER_ELEMENT",
    "MemoryBreakdown",
    "breakdown",
    "clear_tracked",
    "estimate",
    "plot_breakdown",
    "track",
    "tracked_breakdown",
    "zero_partition",
]

#: The categories a breakdown sums, in the order the bars stack them.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication", "activations")

#: State tensors each optimizer keeps per parameter element (each the parameter's dtype), and
#: whether it also keeps a float32 ``step`` scalar per parameter tensor, in torch 2.14 with the
#: default (not fused, not capturable) implementation on CPU.
OPTIMIZER_STATE_PER_ELEMENT: dict[str, tuple[int, bool]] = {
    "sgd": (0, False),
    "sgd_momentum": (1, False),
    "adam": (2, True),
    "adamw": (2, True),
    "adagrad": (1, True),
    "rmsprop": (1, True),
}

_STRATEGIES = ("ddp", "zero1", "fsdp", "tp")
_TP_STYLES = {"colwise": (0, 0), "rowwise": (1, None)}  # dim split: weight, bias (None: whole)
_COLOURS = {
    "parameters": "#66c2a5",
    "gradients": "#fc8d62",
    "optimizer_state": "#8da0cb",
    "communication": "#e78ac3",
    "activations": "#ffd92f",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's bytes by category, measured by :func:`breakdown` or computed by :func:`estimate`.

    Attributes:
        parameters: parameter storages (this rank's shard where sharded), plus module buffers.
        gradients: gradient storages not already counted as parameters.
        optimizer_state: the optimizer's state tensors (for ``ZeroRedundancyOptimizer``, the
            local optimizer's, which holds only this rank's partition).
        communication: communication buffers that stay allocated between steps: DDP's gradient
            buckets, less the part shared with gradients (``gradient_as_bucket_view=True``).
        activations: on a GPU rank, peak allocated bytes minus the categories above: activations
            and every other temporary alive at the peak (a foreach optimizer's parameter-sized
            temporaries, for one); None where it cannot be measured (CPU ranks) or was not
            estimated. :class:`mgtutor.measure.activations.LiveTensors` measures activations alone.
        transient: estimates only: buffers that exist only inside a step and are not in the
            other categories (FSDP's unsharded parameters and gradients of the largest unit);
            None otherwise.
        peak: the allocator's peak (``torch.cuda.max_memory_allocated``) on a GPU rank, the
            process's peak resident memory on a CPU rank, None for an estimate.
        peak_source: what ``peak`` is.
        device: the rank's device, or "estimate".
        notes: what was counted or skipped, in words.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    communication: int
    activations: int | None = None
    transient: int | None = None
    peak: int | None = None
    peak_source: str = ""
    device: str = "estimate"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        """Bytes held between steps, plus activations where measured; ``transient`` is extra."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.communication
            + (self.activations or 0)
        )

    def as_dict(self) -> dict[str, int | None]:
        """The byte categories by name, ``total`` included."""
        out: dict[str, int | None] = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("peak_source", "device", "notes"):
            out.pop(key)
        out["total"] = self.total
        return out

    def __str__(self) -> str:
        parts = [f"{name} {format_bytes(getattr(self, name))}" for name in CATEGORIES]
        return f"MemoryBreakdown({self.device}: " + ", ".join(parts) + ")"


class _Storages:
    """Bytes of distinct storages: each storage counts once, in the first category that sees it."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], int] = {}

    def add(self, tensor: torch.Tensor | None) -> int:
        if tensor is None:
            return 0
        local = _local(tensor)
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return 0
        self.seen[key] = storage.nbytes()
        return storage.nbytes()

    def add_all(self, tensors: Iterable[torch.Tensor | None]) -> int:
        return sum(self.add(t) for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, else the tensor."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


def _state_tensors(state: Any) -> Iterable[torch.Tensor]:
    import torch

    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, Mapping):
        for value in state.values():
            yield from _state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _state_tensors(value)


def _ddp_bucket_bytes(ddp: Any) -> tuple[int, bool]:
    """Total bytes of DDP's gradient buckets and whether gradients are views into them."""
    data = ddp._get_ddp_logging_data()
    sizes = str(data.get("bucket_sizes", "") or "")
    total = sum(int(s) for s in sizes.split(",") if s.strip())
    return total, bool(data.get("gradient_as_bucket_view", 0))


def breakdown(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, ddp: Any = None
) -> MemoryBreakdown:
    """Count this rank's memory by category from the tensors themselves (call it inside a rank).

    What is counted, each storage once, in this order (a storage already counted is not counted
    again in a later category):

    * parameters: ``model.parameters()`` and ``model.buffers()``; a DTensor (FSDP2) by its local
      shard's storage, which FSDP2 pads to an equal size on every rank.
    * gradients: ``p.grad`` of those parameters (the local shard of a DTensor gradient; under
      FSDP2 a unit's gradients are views into one reduce-scatter output, counted once).
    * optimizer_state: every tensor in ``optimizer.state`` (for a ``ZeroRedundancyOptimizer``,
      in its local ``optimizer.optim.state``; Adam's ``step`` scalars included).
    * communication: DDP's gradient buckets, from ``ddp._get_ddp_logging_data()["bucket_sizes"]``
      (bytes per bucket; in torch 2.14 Python reaches the reducer's bucket tensors only from a
      communication hook, and ``reducer._get_zeros_like_grad_buckets()`` gives zeroed copies of
      the same sizes, which the tests check against). With ``gradient_as_bucket_view=True``
      the gradients are views into the buckets, so the bytes of the gradient storages are
      taken off (they are counted as gradients).
      Not counted: the reducer's small per-parameter bookkeeping (``local_used_map`` with
      ``find_unused_parameters=True``), gloo's and NCCL's own staging buffers.
    * activations and peak: on a CUDA device, ``torch.cuda.max_memory_allocated`` since the last
      reset (mgtutor resets it when fn starts), and the activations as that peak minus the
      categories above. On CPU the activations stay None and the peak is the process's peak
      resident memory, which cannot be split: it includes the interpreter and torch's libraries.

    Args:
        model: the module whose parameters to count; a ``DistributedDataParallel`` wrapper is
            accepted and then also used as ``ddp``.
        optimizer: the optimizer (or ``ZeroRedundancyOptimizer``), if any.
        ddp: the ``DistributedDataParallel`` wrapper, when ``model`` is the inner module.

    Returns:
        This rank's :class:`MemoryBreakdown`.

    Example:
        >>> ddp = DDP(model); opt = torch.optim.Adam(ddp.parameters()); ...  # train a step
        >>> memplan.breakdown(ddp, opt).optimizer_state  # 2 x the parameter bytes + steps
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        ddp = model if ddp is None else ddp
        model = model.module
    if ddp is not None and not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"ddp must be the DistributedDataParallel wrapper, got {type(ddp).__name__}; pass "
            "the wrapper as ddp= (or as model) and the inner module as model"
        )
    seen = _Storages()
    params = list(model.parameters())
    param_bytes = seen.add_all(params) + seen.add_all(model.buffers())
    grads = [p.grad for p in params]
    grad_bytes = seen.add_all(grads)
    state_bytes = 0
    if optimizer is not None:
        inner = getattr(optimizer, "optim", None)
        owner = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        state_bytes = seen.add_all(_state_tensors(dict(owner.state)))
    comm_bytes = 0
    notes = []
    if ddp is not None:
        buckets, as_view = _ddp_bucket_bytes(ddp)
        shared = 0
        if as_view:
            own = _Storages()
            shared = own.add_all(g for g in grads if g is not None)
        comm_bytes = max(0, buckets - shared)
        notes.append(
            f"DDP buckets {format_bytes(buckets)}"
            + (", gradients are views into them" if as_view and shared else "")
        )
    device = _device_of(params)
    activations = peak = None
    if device.startswith("cuda") and torch.cuda.is_initialized():
        peak = int(torch.cuda.max_memory_allocated(device))
        counted = param_bytes + grad_bytes + state_bytes + comm_bytes
        activations = max(0, peak - counted)
        source = "torch.cuda.max_memory_allocated"
    else:
        peak = peak_rss()
        source = "peak resident memory of the process (RSS)"
        notes.append(
            "activations: SKIPPED on CPU: the process's peak RSS cannot be split by tensor "
            "(it includes the interpreter and torch's libraries)"
        )
    return MemoryBreakdown(
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer_state=state_bytes,
        communication=comm_bytes,
        activations=activations,
        peak=peak,
        peak_source=source,
        device=device,
        notes=tuple(notes),
    )


def _device_of(params: Sequence[torch.Tensor]) -> str:
    return str(_local(params[0]).device) if params else "cpu"


def zero_partition(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Which parameters ``ZeroRedundancyOptimizer`` gives each rank (torch 2.14, one group).

    Its ``_partition_parameters`` sorts the parameters by ``numel``, largest first (a stable
    sort), and gives each in turn to the rank with the fewest elements so far (the lowest rank
    on a tie). Parameters are never split, so a rank's share is not exactly 1/world_size.

    Args:
        sizes: ``numel`` of each parameter, in the order the optimizer was given them.
        world_size: number of ranks.

    Returns:
        For each rank, the indices (into ``sizes``) of the parameters it updates.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    totals = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = totals.index(min(totals))
        owned[rank].append(index)
        totals[rank] += sizes[index]
    return owned


def _fsdp_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows of dim 0 a rank holds under FSDP2 (torch.chunk), and the padded row count."""
    per_rank = math.ceil(dim0 / world_size)
    return max(0, min(per_rank, dim0 - rank * per_rank)), per_rank


def estimate(
    params: int | nn.Module,
    *,
    dtype: torch.dtype | None = None,
    optimizer: str = "adam",
    world_size: int = 1,
    strategy: str = "ddp",
    gradient_as_bucket_view: bool = False,
    fsdp_units: Sequence[nn.Module] | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> list[MemoryBreakdown]:
    """Bytes per rank by category for a model trained with DDP, ZeRO-1, FSDP or TP (torch 2.14).

    The rules, per rank (P = parameter bytes, S = optimizer state per parameter byte, from
    :data:`OPTIMIZER_STATE_PER_ELEMENT`):

    * ``"ddp"``: parameters P, gradients P, optimizer state S x P, communication P (DDP's
      buckets hold a copy of every gradient; 0 with ``gradient_as_bucket_view=True``).
    * ``"zero1"``: DDP plus ``ZeroRedundancyOptimizer``: as DDP, but the optimizer state only
      for the parameters :func:`zero_partition` gives the rank (whole tensors, largest first).
      Given only a count, the split is assumed even (the best case).
    * ``"fsdp"``: ``fully_shard`` on each of ``fsdp_units`` and then on the whole model.
      Each parameter is split along dim 0 with ``torch.chunk``: a rank's parameters and
      gradients take the padded shard (``ceil(dim0 / world_size)`` rows, equal on every rank),
      its optimizer state only the rows it really holds (state is made with ``zeros_like`` of
      the unpadded shard). ``transient`` is the largest unit's unsharded (padded) parameters,
      all-gathered for its forward and backward, plus its unsharded gradients, which autograd
      makes in that unit's backward and which live until they are reduce-scattered.
    * ``"tp"``: tensor parallelism, ``parallelize_module`` with ``tp_plan`` mapping a Linear's
      name to ``"colwise"`` (``ColwiseParallel``: weight and bias ``Shard(0)``) or
      ``"rowwise"`` (``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate()``). A sharded
      tensor is cut with ``torch.chunk`` and not padded (a DTensor's local shard); every
      other parameter is whole on every rank (``SequenceParallel``'s norms included).
      Parameters, gradients and optimizer state each take the local size; no communication
      buffer stays between steps. The same rules hold for :mod:`mgtutor.parallel.tensor`'s
      layers built by hand, which keep the same slices.

    Adam's, AdamW's, Adagrad's and RMSprop's ``step`` counters add 4 bytes per parameter tensor
    (counted when a module is given; a bare count has no tensors to count). Left out
    everywhere: activations (they depend on the batch; see the notebook's saved-tensor count),
    the allocator's cache, mixed-precision copies, and temporaries inside a step: FSDP2 also
    holds the all-gather output before it copies it out, the reduce-scatter input in backward,
    and prefetches the next unit, so its peak holds more than ``transient``.

    Args:
        params: a parameter count, or the module (its ``requires_grad`` parameters; buffers
            count as parameters, replicated under every strategy).
        dtype: the parameters' dtype; by default the module's (float32 for a count).
        optimizer: a key of :data:`OPTIMIZER_STATE_PER_ELEMENT`.
        world_size: number of ranks.
        strategy: "ddp", "zero1" or "fsdp".
        gradient_as_bucket_view: DDP's option of that name (ddp and zero1).
        fsdp_units: the submodules given ``fully_shard`` before the root (fsdp with a module).
        tp_plan: for "tp", the module names of the split Linears and their style, "colwise" or
            "rowwise".

    Returns:
        One :class:`MemoryBreakdown` per rank, in rank order.

    Raises:
        ValueError: for an unknown strategy or optimizer, or a world size below 1; for "tp"
            without a module, with an unknown style or a name that is not a Linear.
    """
    import torch
    from torch import nn

    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
    if optimizer not in OPTIMIZER_STATE_PER_ELEMENT:
        raise ValueError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_PER_ELEMENT)}, got {optimizer!r}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    per_element, has_step = OPTIMIZER_STATE_PER_ELEMENT[optimizer]
    if isinstance(params, nn.Module):
        module = params
        tensors = [p for p in module.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in tensors]
        buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        if dtype is None:
            dtype = tensors[0].dtype if tensors else torch.float32
    else:
        module = None
        tensors = []
        shapes = [(int(params),)]
        buffer_bytes = 0
        has_step = False
    dtype = dtype or torch.float32
    item = torch.empty((), dtype=dtype).element_size()
    step_bytes = 4 if has_step else 0
    numels = [math.prod(s) for s in shapes]
    total = sum(numels) * item
    out = []
    if strategy in ("ddp", "zero1"):
        owned = (
            zero_partition(numels, world_size)
            if strategy == "zero1" and module is not None
            else [list(range(len(numels)))] * world_size
        )
        for rank in range(world_size):
            if strategy == "zero1" and module is None:
                share = numels[0] // world_size + (rank < numels[0] % world_size)
                state = share * item * per_element
            else:
                state = sum(numels[i] * item * per_element + step_bytes for i in owned[rank])
            out.append(
                MemoryBreakdown(
                    parameters=total + buffer_bytes,
                    gradients=total,
                    optimizer_state=state,
                    communication=0 if gradient_as_bucket_view else total,
                )
            )
        return out
    if strategy == "tp":
        return _estimate_tp(module, tp_plan or {}, world_size, item, per_element, step_bytes)
    units = _fsdp_unit_shapes(module, tensors, fsdp_units) if module is not None else [shapes]
    # An all-gather fills world_size padded shards: the unit's unsharded size, padding included.
    largest = (
        max(
            sum(_fsdp_rows(s[0] if s else 1, world_size, 0)[1] * math.prod(s[1:]) for s in unit)
            for unit in units
        )
        * world_size
    )
    for rank in range(world_size):
        padded = held = 0
        for shape in shapes:
            rows, padded_rows = _fsdp_rows(shape[0] if shape else 1, world_size, rank)
            row = math.prod(shape[1:])
            padded += padded_rows * row
            held += rows * row
        out.append(
            MemoryBreakdown(
                parameters=padded * item + buffer_bytes,
                gradients=padded * item,
                optimizer_state=held * item * per_element + step_bytes * len(shapes),
                communication=0,
                transient=2 * largest * item,
            )
        )
    return out


def _estimate_tp(
    module: nn.Module | None,
    plan: Mapping[str, str],
    world_size: int,
    item: int,
    per_element: int,
    step_bytes: int,
) -> list[MemoryBreakdown]:
    """Per rank: each parameter's local shard under ``parallelize_module(module, mesh, plan)``."""
    from torch import nn

    if module is None:
        raise ValueError("strategy 'tp' needs the module: a bare count does not say what is split")
    split: dict[int, int | None] = {}
    for name, style in plan.items():
        if style not in _TP_STYLES:
            raise ValueError(
                f"tp_plan[{name!r}] must be one of {sorted(_TP_STYLES)}, got {style!r}"
            )
        layer = module.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"tp_plan names {name!r}, a {type(layer).__name__}, not an nn.Linear")
        weight_dim, bias_dim = _TP_STYLES[style]
        split[id(layer.weight)] = weight_dim
        if layer.bias is not None:
            split[id(layer.bias)] = bias_dim
    out = []
    for rank in range(world_size):
        held = tensors = 0
        for p in module.parameters():
            if not p.requires_grad:
                continue
            dim = split.get(id(p))
            shape = list(p.shape)
            if dim is not None:
                shape[dim] = _fsdp_rows(shape[dim], world_size, rank)[0]
            held += math.prod(shape)
            tensors += 1
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        out.append(
            MemoryBreakdown(
                parameters=held * item + buffers,
                gradients=held * item,
                optimizer_state=held * item * per_element + step_bytes * tensors,
                communication=0,
            )
        )
    return out


def _fsdp_unit_shapes(
    module: nn.Module, tensors: Sequence[torch.Tensor], units: Sequence[nn.Module] | None
) -> list[list[tuple[int, ...]]]:
    """Parameter shapes per FSDP unit: each given unit, then the root's remaining parameters."""
    taken: set[int] = set()
    groups = []
    for unit in units or ():
        own = [p for p in unit.parameters() if p.requires_grad and id(p) not in taken]
        taken.update(id(p) for p in own)
        groups.append([tuple(p.shape) for p in own])
    groups.append([tuple(p.shape) for p in tensors if id(p) not in taken])
    return [g for g in groups if g] or [[]]


def plot_breakdown(
    breakdowns: Sequence[MemoryBreakdown]
    | Mapping[int, MemoryBreakdown]
    | Mapping[str, Sequence[MemoryBreakdown]],
    *,
    title: str = "Memory by category per rank",
    ax: Axes | None = None,
) -> Figure:
    """One stacked bar per rank: parameters, gradients, optimizer state, communication, ...

    Activations are stacked only where they were measured (GPU ranks); an estimate's
    ``transient`` bytes (FSDP's unit, gathered, with its gradients) are drawn hatched on top.

    Args:
        breakdowns: a list indexed by rank, a dict by rank, or a dict from a label (say
            "DDP", "FSDP") to such a list, drawn as groups side by side.
        title: the plot's title.
        ax: draw on these axes (say, beside :func:`mgtutor.plot_memory`'s bars) instead of on
            a new figure.

    Returns:
        The figure (the one holding ``ax`` when it is given).

    Raises:
        ValueError: when there is nothing to draw.
    """
    from mgtutor.measure.plots import _new_figure

    bars: list[tuple[str, MemoryBreakdown]] = []
    if isinstance(breakdowns, Mapping):
        for key, value in breakdowns.items():
            if isinstance(value, MemoryBreakdown):
                bars.append((f"rank {key}", value))
            else:
                bars.extend((f"{key}\nrank {r}", b) for r, b in enumerate(value))
    else:
        bars = [(f"rank {r}", b) for r, b in enumerate(breakdowns)]
    if not bars:
        raise ValueError("no breakdowns to plot: pass a list of MemoryBreakdown, one per rank")
    if ax is None:
        ax = _new_figure(max(5.5, 1.8 + 1.0 * len(bars)), 4.4).add_subplot()
    unit, scale = _unit_for(max(b.total for _, b in bars))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for name in CATEGORIES:
        values = [(getattr(b, name) or 0) / scale for _, b in bars]
        if not any(values):
            continue
        ax.bar(xs, values, 0.6, bottom=bottom, label=name.replace("_", " "), color=_COLOURS[name])
        bottom = [b + v for b, v in zip(bottom, values)]
    transient = [(b.transient or 0) / scale for _, b in bars]
    if any(transient):
        drawn = [x for x in xs if transient[x]]  # no empty outlined box where there is none
        ax.bar(
            drawn,
            [transient[x] for x in drawn],
            0.6,
            bottom=[bottom[x] for x in drawn],
            label="transient (unit gathered, with its gradients)",
            color="white",
            edgecolor="#555555",
            hatch="//",
        )
        bottom = [b + v for b, v in zip(bottom, transient)]
    for x, (_, b) in zip(xs, bars):
        text = format_bytes(b.total) + (f"\n+{format_bytes(b.transient)}" if b.transient else "")
        ax.annotate(text, (x, bottom[x]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    # Room above the tallest bar for its label (two lines with a transient): margins alone
    # were not kept once the hatched bars were drawn, and the labels ran into the title.
    ax.set_ylim(0, max(bottom) * (1.25 if any(transient) else 1.15))
    return ax.figure


def _unit_for(largest: int) -> tuple[str, float]:
    for unit, scale in (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0


_tracked: dict[str, Any] = {}


def track(model: nn.Module, optimizer: Any = None, *, ddp: Any = None) -> None:
    """Name the model and optimizer whose memory this rank's record should break down.

    Call it inside fn once they exist; when fn returns, the rank calls
    :func:`tracked_breakdown` and the run's memory plot stacks the categories. In a
    :class:`mgtutor.Pool` the tracking stays for the later calls too. A later ``track`` replaces
    the earlier one; :func:`clear_tracked` forgets it.

    Args:
        model: the module (or its DistributedDataParallel wrapper).
        optimizer: its optimizer, if any.
        ddp: the DistributedDataParallel wrapper, when ``model`` is the inner module.
    """
    _tracked.clear()
    _tracked.update(model=model, optimizer=optimizer, ddp=ddp)


def clear_tracked() -> None:
    """Forget what :func:`track` named."""
    _tracked.clear()


def tracked_breakdown() -> MemoryBreakdown | None:
    """The :func:`breakdown` of what :func:`track` named, or None if nothing was tracked."""
    if not _tracked:
        return None
    tracked = dict(_tracked)
    return breakdown(tracked["model"], tracked["optimizer"], ddp=tracked["ddp"])
