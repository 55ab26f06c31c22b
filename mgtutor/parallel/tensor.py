"""Tensor and sequence parallelism by hand: layers whose weights are split across ranks.

A transformer block of one process (:class:`Block`: LayerNorm, :class:`Attention`, LayerNorm,
:class:`MLP`, each branch with dropout and a residual) and the same block split over the ranks of
a process group (:class:`ParallelBlock`), as Megatron-LM splits it. Each piece takes ``group``,
the tensor-parallel ranks (None: the default group, every rank); with data parallelism as well,
it is ``build_groups(Layout(...)).tp_group`` (:mod:`.layout`):

* :class:`ColumnParallelLinear`: rank r keeps rows r of the weight (``torch.chunk`` along the
  output features) and computes its share of the outputs; the input must be whole on every rank.
* :class:`RowParallelLinear`: rank r keeps columns r of the weight, multiplies its share of the
  inputs and the ranks sum their partial outputs; the bias is added once, after the sum.
* :class:`ParallelMLP`: column-parallel then row-parallel, so the activation between them stays
  split and the block needs one collective forward and one backward.
* :class:`HeadParallelAttention`: query, key and value column-parallel (each rank computes whole
  heads, ``n_heads / world_size`` of them), the output projection row-parallel.

With ``sequence_parallel=True`` the block's input and output are split along the sequence: the
LayerNorms and dropouts run on each rank's share of the tokens, and the all-reduce around each
parallel region becomes an all-gather before it and a reduce-scatter after it (see
:mod:`mgtutor.parallel.tensor_comms`). The parameters every rank keeps whole (the norms, the
row-parallel biases) then see only this rank's tokens: :func:`all_reduce_replicated_grads` sums
their gradients after backward.

Every split layer is built from the one-process layer, so each rank's slice can be checked
against the whole: :func:`shard_of` says which rows and columns of which parameter a rank
holds, :func:`take_shard` cuts that part out of a one-process tensor, and
:func:`gradient_errors` compares every gradient with its part of the one-process one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mgtutor.parallel.tensor_comms import (
    Group,
    copy_to_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
)

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "ColumnParallelLinear",
    "HeadParallelAttention",
    "ParallelBlock",
    "ParallelMLP",
    "RowParallelLinear",
    "all_reduce_replicated_grads",
    "gradient_errors",
    "shard_of",
    "take_shard",
]

SEQUENCE_DIM = 1  # inputs are (batch, sequence, features)


class Attention(nn.Module):
    """Causal multi-head self-attention of one process, with separate q, k, v and output layers."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} must be a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(_attend(x, self.q, self.k, self.v, self.n_heads))


class MLP(nn.Module):
    """``down(gelu(up(x)))``, the feed-forward part of a transformer block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + drop(attn(norm1(x)))``, then the same with the MLP."""

    def __init__(self, dim: int = 32, n_heads: int = 4, hidden: int = 128, p: float = 0.0):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, n_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


def _attend(x: torch.Tensor, q: nn.Module, k: nn.Module, v: nn.Module, heads: int) -> torch.Tensor:
    b, s, _ = x.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, heads, -1).transpose(1, 2)  # (batch, heads, sequence, head dim)

    y = F.scaled_dot_product_attention(split(q(x)), split(k(x)), split(v(x)), is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1)


def _world(group: Group) -> tuple[int, int]:
    """This rank's place in ``group`` and its size (None: the default group)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _piece(tensor: torch.Tensor, dim: int, rank: int, world: int, what: str) -> torch.Tensor:
    if tensor.shape[dim] % world:
        raise ValueError(
            f"cannot split {what} of shape {tuple(tensor.shape)} along dim {dim} into {world} "
            f"equal parts: choose sizes that are multiples of the world size"
        )
    return tensor.detach().chunk(world, dim)[rank].clone()


def _choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}: a misspelt option "
            f"would otherwise run the layer with the wrong collective, or none"
        )


class ColumnParallelLinear(nn.Module):
    """Rank r computes outputs r of ``linear``: ``x @ W_r.T + b_r``, its rows of W and b.

    Args:
        linear: the one-process layer to split (every rank passes the same one).
        enter: how the input arrives: "copy" (whole on every rank: :func:`copy_to_parallel`),
            "gather" (split along the sequence: :func:`gather_from_sequence`), or None when the
            caller already did it (attention enters once for q, k and v).
        group: the tensor-parallel ranks; None for the default group.
    """

    def __init__(self, linear: nn.Linear, enter: str | None = "copy", group: Group = None) -> None:
        super().__init__()
        _choice("enter", enter, ("copy", "gather", None))
        rank, world = _world(group)
        self.enter, self.group = enter, group
        self.rows = (rank * linear.out_features // world, (rank + 1) * linear.out_features // world)
        self.weight = nn.Parameter(_piece(linear.weight, 0, rank, world, "the weight"))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(_piece(bias, 0, rank, world, "the bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter == "copy":
            x = copy_to_parallel(x, self.group)
        elif self.enter == "gather":
            x = gather_from_sequence(x, SEQUENCE_DIM, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r multiplies its inputs by its columns of W; the partial sums are summed, then ``+ b``.

    Args:
        linear: the one-process layer to split.
        leave: "reduce" (:func:`reduce_from_parallel`: the whole output on every rank) or
            "scatter" (:func:`reduce_scatter_to_sequence`: each rank its share of the sequence).
        group: the tensor-parallel ranks; None for the default group.
    """

    def __init__(self, linear: nn.Linear, leave: str = "reduce", group: Group = None) -> None:
        super().__init__()
        _choice("leave", leave, ("reduce", "scatter"))
        rank, world = _world(group)
        self.leave, self.group = leave, group
        self.cols = (rank * linear.in_features // world, (rank + 1) * linear.in_features // world)
        self.weight = nn.Parameter(_piece(linear.weight, 1, rank, world, "the weight"))
        bias = linear.bias  # whole on every rank: added once, after the sum
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.leave == "scatter":
            y = reduce_scatter_to_sequence(partial, SEQUENCE_DIM, self.group)
        else:
            y = reduce_from_parallel(partial, self.group)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """:class:`MLP` split: ``up`` column-parallel, ``down`` row-parallel, GELU on the split."""

    def __init__(self, mlp: MLP, sequence_parallel: bool = False, group: Group = None) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(mlp.up, "gather" if sequence_parallel else "copy", group)
        self.down = RowParallelLinear(mlp.down, "scatter" if sequence_parallel else "reduce", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class HeadParallelAttention(nn.Module):
    """:class:`Attention` split by heads: rank r computes heads r, the output layer sums them."""

    def __init__(
        self, attn: Attention, sequence_parallel: bool = False, group: Group = None
    ) -> None:
        super().__init__()
        _, world = _world(group)
        if attn.n_heads % world:
            raise ValueError(f"{attn.n_heads} heads cannot be split evenly over {world} ranks")
        self.n_heads = attn.n_heads // world
        self.enter, self.group = "gather" if sequence_parallel else "copy", group
        self.q, self.k, self.v = (
            ColumnParallelLinear(m, None, group) for m in (attn.q, attn.k, attn.v)
        )
        self.o = RowParallelLinear(attn.o, "scatter" if sequence_parallel else "reduce", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One collective for q, k and v together: all three read the same input.
        if self.enter == "copy":
            x = copy_to_parallel(x, self.group)
        else:
            x = gather_from_sequence(x, SEQUENCE_DIM, self.group)
        return self.o(_attend(x, self.q, self.k, self.v, self.n_heads))


class ParallelBlock(nn.Module):
    """:class:`Block` split over the ranks: tensor parallel, or with ``sequence_parallel=True``
    the norms and dropouts on this rank's share of the sequence (input and output split).
    ``group``: the tensor-parallel ranks (None: the default group)."""

    def __init__(self, block: Block, sequence_parallel: bool = False, group: Group = None) -> None:
        super().__init__()
        self.sequence_parallel, self.group = sequence_parallel, group
        self.norm1 = _copy_of(block.norm1)
        self.attn = HeadParallelAttention(block.attn, sequence_parallel, group)
        self.norm2 = _copy_of(block.norm2)
        self.mlp = ParallelMLP(block.mlp, sequence_parallel, group)
        self.drop = nn.Dropout(block.drop.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters every rank keeps whole: the norms and the row-parallel biases."""
        biases = [b for b in (self.attn.o.bias, self.mlp.down.bias) if b is not None]
        return [*self.norm1.parameters(), *self.norm2.parameters(), *biases]


def _copy_of(norm: nn.LayerNorm) -> nn.LayerNorm:
    return copy.deepcopy(norm)  # its own tensors, same dtype and options


def all_reduce_replicated_grads(modules: Any, group: Group = None) -> None:
    """Sum, over the ranks, the gradients of the parameters each rank keeps whole.

    The ranks are the tensor-parallel group (``group``; None: the default group): with data
    parallelism as well, this sum is over another group than the data-parallel all-reduce and is
    not folded into it (Megatron-LM's ``_allreduce_non_tensor_model_parallel_grads``,
    finalize_model_grads.py).

    Needed after backward under sequence parallelism only: each rank's norms and biases then saw
    its share of the tokens, so each holds a partial gradient. One all-reduce of all of them; it
    runs after backward, so :func:`~.comms.record_comms` records it in phase "forward".

    Args:
        modules: a :class:`ParallelBlock` or an iterable of them.
        group: the tensor-parallel ranks the blocks were split over; None for the default group.
    """
    blocks = [modules] if isinstance(modules, ParallelBlock) else list(modules)
    grads = [p.grad for b in blocks for p in b.replicated_parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


def shard_of(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Which rows and columns of each parameter of the split layers this rank holds.

    Returns:
        By parameter name, for the column- and row-parallel layers: ``{"rows": (start, stop)
        or None, "cols": (start, stop) or None, "shape": the local shape}``, None meaning all
        of them (a row-parallel bias is whole on every rank).
    """
    out = {}
    for name, layer in module.named_modules():
        if isinstance(layer, ColumnParallelLinear):
            out[f"{name}.weight"] = {"rows": layer.rows, "cols": None}
            out[f"{name}.bias"] = {"rows": layer.rows, "cols": None}
        elif isinstance(layer, RowParallelLinear):
            out[f"{name}.weight"] = {"rows": None, "cols": layer.cols}
            out[f"{name}.bias"] = {"rows": None, "cols": None}
        else:
            continue
        out[f"{name}.weight"]["shape"] = tuple(layer.weight.shape)
        if layer.bias is None:
            del out[f"{name}.bias"]
        else:
            out[f"{name}.bias"]["shape"] = tuple(layer.bias.shape)
    return out


def take_shard(tensor: torch.Tensor, shard: dict[str, Any] | None) -> torch.Tensor:
    """The part of a one-process ``tensor`` that a rank holds, by :func:`shard_of`'s entry."""
    if shard is None:
        return tensor
    if shard["rows"] is not None:
        tensor = tensor[shard["rows"][0] : shard["rows"][1]]
    if shard["cols"] is not None:
        tensor = tensor[:, shard["cols"][0] : shard["cols"][1]]
    return tensor


def gradient_errors(reference: nn.Module, parallel: nn.Module) -> dict[str, float]:
    """Largest difference of each split parameter's gradient from its part of the reference's.

    Args:
        reference: the one-process module, after its backward.
        parallel: the module split from it (same parameter names), after its backward.

    Returns:
        By parameter name, the largest absolute difference (``inf`` where a gradient is
        missing).
    """
    shards = shard_of(parallel)
    full = dict(reference.named_parameters())
    out = {}
    for name, p in parallel.named_parameters():
        want = full[name].grad
        if p.grad is None or want is None:
            out[name] = float("inf")
            continue
        out[name] = (p.grad - take_shard(want, shards.get(name))).abs().max().item()
    return out
