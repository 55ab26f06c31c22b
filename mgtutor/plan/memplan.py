"""Where a rank's memory will go, computed ahead: the memory plan of a strategy.

:func:`estimate` computes, per rank and before anything runs, the bytes that
:func:`~mgtutor.measure.breakdown.breakdown` measures inside the ranks (parameters, gradients,
optimizer state, DDP's buckets) for DDP, ZeRO-1 (DDP plus ``ZeroRedundancyOptimizer``), FSDP
(``fully_shard``) and tensor parallelism, following torch's rules (see its docstring for each
rule and what it leaves out). :func:`zero_partition` is ZeRO-1's split of the parameters.

:class:`MemoryBreakdown` is the record both sides fill: an estimate here, a measurement in
:mod:`mgtutor.measure.breakdown`, so that notebook 12 sets ``memplan.estimate(...)`` beside
``breakdown(...)`` field by field.

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from mgtutor.units import format_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CATEGORIES",
    "OPTIMIZER_STATE_PER_ELEMENT",
    "MemoryBreakdown",
    "estimate",
    "zero_partition",
]

#: The categories a breakdown sums, in the order the bars stack them.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "communication",
    "activations",
    "rest_of_peak",
)


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's bytes by category, measured (in :mod:`mgtutor.measure.breakdown`) or estimated.

    Attributes:
        parameters: parameter storages (this rank's shard where sharded), plus module buffers.
        gradients: gradient storages not already counted as parameters.
        optimizer_state: the optimizer's state tensors (for ``ZeroRedundancyOptimizer``, the
            local optimizer's, which holds only this rank's partition).
        communication: communication buffers that stay allocated between steps: DDP's gradient
            buckets, less the part shared with gradients (``gradient_as_bucket_view=True``).
        activations: the most bytes autograd held for backward at the end of the tracked
            model's forward (:class:`~mgtutor.measure.activations.SavedActivations`, on any
            device); None where nothing watched the forward (a :func:`breakdown` called without
            :func:`track`) or it was not estimated.
        rest_of_peak: on a GPU rank, the allocator's peak less every category above: library
            workspaces, temporaries alive at the peak (a foreach optimizer's parameter-sized
            ones, for one), the allocator's rounding, and the activations when nothing measured
            them; so the categories add up to the peak. None on CPU ranks and in estimates.
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
    rest_of_peak: int | None = None
    transient: int | None = None
    peak: int | None = None
    peak_source: str = ""
    device: str = "estimate"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        """The categories' sum: the peak on a GPU rank (see ``notes`` where they exceed it).

        ``transient`` is extra.
        """
        return sum(getattr(self, name) or 0 for name in CATEGORIES)

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


#: State tensors each optimizer keeps per parameter element (each the parameter's dtype), and
#: whether it also keeps a float32 ``step`` scalar per parameter tensor, with the default (not
#: fused, not capturable) implementation on CPU (torch's ``torch/optim/``, read in 2.14.1).
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


def zero_partition(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Which parameters ``ZeroRedundancyOptimizer`` gives each rank (one parameter group).

    Its ``_partition_parameters`` (read in torch 2.14.1) sorts the parameters by ``numel``,
    largest first (a stable sort), and gives each in turn to the rank with the fewest elements
    so far (the lowest rank on a tie). Parameters are never split, so a rank's share is not
    exactly 1/world_size.

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
    """Bytes per rank by category for a model trained with DDP, ZeRO-1, FSDP or TP.

    torch's rules (read in 2.14.1), per rank (P = parameter bytes, S = optimizer state per
    parameter byte, from :data:`OPTIMIZER_STATE_PER_ELEMENT`):

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
