"""Where a rank's memory goes, measured: the bytes of the tensors a training step keeps.

:func:`breakdown`, called inside a rank, counts parameters (and buffers), gradients, optimizer
state and DDP's communication buckets. Each storage is counted once, so a gradient that is a
view into a DDP bucket (``gradient_as_bucket_view=True``) or a parameter that is a view into a
flat shard is not counted twice; a sharded parameter (a DTensor, as FSDP2's ``fully_shard``
makes) counts by the shard this rank holds, padding included.

Activations are what autograd saved for backward inside the tracked model's forward, measured
on any device by :class:`mgtutor.measure.activations.SavedActivations`, which :func:`track`
attaches to the model. The peak comes from the allocator: on a GPU rank
``torch.cuda.max_memory_allocated``, and what the categories leave of it is its own category,
``rest_of_peak``: library workspaces (cuBLAS and cuDNN keep theirs allocated), temporaries alive
at the peak, the allocator's rounding. On a CPU rank only the process's peak resident memory is
known, which also holds the interpreter and torch's libraries (several hundred MiB), so the rest
is left unknown (None) there.

:func:`track` and :func:`tracked_breakdown` let a worker's fn name its model and optimizer so
that the breakdown can be taken when fn returns. :mod:`mgtutor.plan.memplan` computes the
same record ahead of any run; :func:`mgtutor.measure.plots.plot_breakdown` draws it.

torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mgtutor.measure.memory import peak_rss
from mgtutor.plan.memplan import MemoryBreakdown
from mgtutor.units import format_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "breakdown",
    "clear_tracked",
    "reset_tracked_peak",
    "track",
    "tracked_breakdown",
]


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
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    ddp: Any = None,
    activations: int | None = None,
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
      (bytes per bucket; Python reaches the reducer's bucket tensors only from a
      communication hook, and ``reducer._get_zeros_like_grad_buckets()`` gives zeroed copies of
      the same sizes, which the tests check against). With ``gradient_as_bucket_view=True``
      the gradients are views into the buckets, so the bytes of the gradient storages are
      taken off (they are counted as gradients).
      Not counted: the reducer's small per-parameter bookkeeping (``local_used_map`` with
      ``find_unused_parameters=True``), gloo's and NCCL's own staging buffers.
    * activations: as given (:func:`track` passes what autograd saved in the model's forward).
    * peak and rest_of_peak: on a CUDA device, ``torch.cuda.max_memory_allocated`` since the
      last reset (mgtutor resets it when fn starts), and what the categories above leave of it
      (workspaces, temporaries, rounding; activations too when not given). On CPU the rest stays
      None and the peak is the process's peak resident memory, which cannot be split: it
      includes the interpreter and torch's libraries.

    Args:
        model: the module whose parameters to count; a ``DistributedDataParallel`` wrapper is
            accepted and then also used as ``ddp``.
        optimizer: the optimizer (or ``ZeroRedundancyOptimizer``), if any.
        ddp: the ``DistributedDataParallel`` wrapper, when ``model`` is the inner module.
        activations: the bytes autograd saved for backward, if measured (see
            :class:`~mgtutor.measure.activations.SavedActivations`).

    Returns:
        This rank's :class:`MemoryBreakdown`.

    Example:
        >>> ddp = DDP(model); opt = torch.optim.Adam(ddp.parameters()); ...  # train a step
        >>> breakdown(ddp, opt).optimizer_state  # 2 x the parameter bytes + steps
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
    rest = None
    if device.startswith("cuda") and torch.cuda.is_initialized():
        peak = int(torch.cuda.max_memory_allocated(device))
        counted = param_bytes + grad_bytes + state_bytes + comm_bytes + (activations or 0)
        rest = max(0, peak - counted)
        source = "torch.cuda.max_memory_allocated"
        if counted > peak:
            notes.append(
                f"the categories exceed the peak by {format_bytes(counted - peak)}: they were "
                "not all alive at once (gradients freed by zero_grad while activations peaked)"
            )
    else:
        peak = peak_rss()
        source = "peak resident memory of the process (RSS)"
        skipped = "activations" if activations is None else "rest of the peak"
        notes.append(
            f"{skipped}: SKIPPED on CPU: the process's peak RSS cannot be split by tensor "
            "(it includes the interpreter and torch's libraries)"
        )
    return MemoryBreakdown(
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer_state=state_bytes,
        communication=comm_bytes,
        activations=activations,
        rest_of_peak=rest,
        peak=peak,
        peak_source=source,
        device=device,
        notes=tuple(notes),
    )


def _device_of(params: Sequence[torch.Tensor]) -> str:
    return str(_local(params[0]).device) if params else "cpu"


_tracked: dict[str, Any] = {}


def track(model: nn.Module, optimizer: Any = None, *, ddp: Any = None) -> None:
    """Name the model and optimizer whose memory this rank's record should break down.

    Call it inside fn once they exist; when fn returns, the rank calls
    :func:`tracked_breakdown` and the run's memory plot stacks the categories. To measure the
    activations, ``track`` puts hooks on ``model`` that note what autograd saves in its forward
    (:class:`~mgtutor.measure.activations.SavedActivations`). In a :class:`mgtutor.Pool` the
    tracking stays for the later calls too. A later ``track`` replaces the earlier one;
    :func:`clear_tracked` forgets it and takes the hooks off.

    Args:
        model: the module (or its DistributedDataParallel wrapper).
        optimizer: its optimizer, if any.
        ddp: the DistributedDataParallel wrapper, when ``model`` is the inner module.
    """
    from mgtutor.measure.activations import SavedActivations

    clear_tracked()
    watch = SavedActivations(model)
    _tracked.update(model=model, optimizer=optimizer, ddp=ddp, activations=watch)


def clear_tracked() -> None:
    """Forget what :func:`track` named, and take its hooks off the model."""
    watch = _tracked.get("activations")
    if watch is not None:
        watch.remove()
    _tracked.clear()


def reset_tracked_peak() -> None:
    """Start the tracked activations' peak again (mgtutor does it when each call's fn starts)."""
    watch = _tracked.get("activations")
    if watch is not None:
        watch.reset_peak()


def tracked_breakdown() -> MemoryBreakdown | None:
    """The :func:`breakdown` of what :func:`track` named, or None if nothing was tracked."""
    if not _tracked:
        return None
    tracked = dict(_tracked)
    return breakdown(
        tracked["model"],
        tracked["optimizer"],
        ddp=tracked["ddp"],
        activations=tracked["activations"].peak,
    )
