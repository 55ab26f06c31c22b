"""The collectives of tensor and sequence parallelism, as autograd functions.

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
of a run that combines it with data parallelism). What they ran is recorded at the dispatcher by
:func:`mgtutor.parallel.comms.record_comms`, with the pass it ran in. The all-gather and
reduce-scatter are ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` (torch 2.14
deprecates the older names, ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which are
used where the new ones do not exist, as in 2.4); gloo runs both on CPU (measured with 2.4.1
and 2.14.1). They work along dim 0, so another dim is moved to the front.

torch's ``CommDebugMode``
(``torch.distributed.tensor.debug``) counts the same operators; on torch 2.11 to 2.13 it raises
IndexError in ``_fw_set_module_hook`` when a module runs twice in one forward, as
``tensor.Block``'s dropout does (each run adds a forward hook that pops the module's parent, so
the second run pops twice; 2.14's ``debug/_comm_mode.py`` removes the earlier hook first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: A process group, or None for the default group (what ``torch.distributed`` takes).
Group = dist.ProcessGroup | None

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "CopyToParallel",
    "ReduceFromParallel",
    "all_gather_along",
    "copy_to_parallel",
    "gather_from_sequence",
    "reduce_from_parallel",
    "reduce_scatter_along",
    "reduce_scatter_to_sequence",
]


def _all_reduce(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    # A copy: autograd may hand the same gradient tensor to both branches of a residual.
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def all_gather_along(tensor: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """Every rank's ``tensor`` joined along ``dim`` (an all_gather)."""
    front = tensor.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * dist.get_world_size(group), *front.shape[1:]))
    _ALL_GATHER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy, which the next layer may keep


def reduce_scatter_along(tensor: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """This rank's slice along ``dim`` of the ranks' summed ``tensor`` (a reduce_scatter)."""
    world = dist.get_world_size(group)
    if tensor.shape[dim] % world:
        raise ValueError(
            f"rank {dist.get_rank()}: cannot reduce-scatter dim {dim} of size "
            f"{tensor.shape[dim]} over {world} ranks; make the sequence a multiple of {world}"
        )
    front = tensor.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _REDUCE_SCATTER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy, which the next layer may keep


class CopyToParallel(torch.autograd.Function):
    """Copy in forward, all-reduce in backward: the f of Megatron-LM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """All-reduce in forward, copy in backward: the g of Megatron-LM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence in forward, reduce-scatter along it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather along it in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Enter a tensor-parallel region: ``x`` unchanged forward; its gradient all-reduced backward.

    Every rank's part of the layer uses the whole ``x``, so ``x``'s gradient is the sum of each
    rank's contribution (Megatron-LM's f). ``group``: the tensor-parallel ranks (None: all).
    """
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Leave a tensor-parallel region: partial sums all-reduced forward; gradient copied backward.

    Megatron-LM's g: each rank's row-parallel product is a partial sum of the output.
    ``group``: the tensor-parallel ranks (None: all).
    """
    return ReduceFromParallel.apply(x, group)


def gather_from_sequence(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Sequence shards to the whole sequence: all-gather forward, reduce-scatter backward."""
    return _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Partial sums to summed sequence shards: reduce-scatter forward, all-gather backward."""
    return _ReduceScatterToSequence.apply(x, dim, group)
