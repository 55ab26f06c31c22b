"""Expert parallelism by hand: a top-k router, its capacity, and tokens sent to their experts.

A mixture-of-experts layer (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021,
arXiv:2101.03961) sends each token to the ``k`` experts its router scores highest. With the
experts spread across ranks (rank ``r`` holds experts ``r * E/R`` to ``(r+1) * E/R - 1``), each
rank sorts its tokens by the rank that holds their expert and exchanges them with one
``dist.all_to_all_single``; the experts' outputs come back with a second one:

================================  =================================  ============================
call                              forward                            backward
================================  =================================  ============================
dispatch ``all_to_all(x, s, r)``  ``s[i]`` rows to rank i, ``r[i]``  combine-shaped: the received
                                  rows from it                       rows' gradients sent back
combine ``all_to_all(y, r, s)``   the results back to their ranks    dispatch-shaped
================================  =================================  ============================

The backward of a dispatch is a combine-shaped all-to-all, and vice versa.
:func:`mgtutor.parallel.comms.record_comms` records each exchange that ran (the small exchange of
per-expert counts before the dispatch, one int64 per expert, included), with its phase and the
bytes it sent to and received from each rank (``sent_to``, ``received_from``); the layer keeps
the rows that arrived (``ExpertParallelMoE.last["arrived"]``).
:class:`MoE` is the one-process layer;
:class:`ExpertParallelMoE` the same layer on ranks, built from it. Capacity is applied per
group of tokens (a rank's tokens), first choices in token order, then second choices (as
DeepSpeed's ``top2gating`` does); a token whose every choice is dropped gets 0 from the layer (a
transformer's residual connection carries it on).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ExpertParallelMoE",
    "MoE",
    "all_to_all",
    "capacity",
    "keep_within_capacity",
    "load_balancing_loss",
    "plan_dispatch",
]


def _exchange(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``send[r]`` to rank r forward; the gradients of the received rows back backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        return _exchange(x, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad, ctx.recv, ctx.send), None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Send ``x``'s rows in consecutive blocks of ``send[r]`` rows to rank r; differentiable.

    Returns the ``sum(recv)`` rows received, rank 0's first. Backward sends each received
    row's gradient back to the rank it came from (the same call with ``send`` and ``recv``
    swapped), so a dispatch's backward is a combine and a combine's backward a dispatch.
    """
    if sum(send) != x.shape[0]:
        raise ValueError(
            f"rank {dist.get_rank()}: send splits sum to {sum(send)}, x has "
            f"{x.shape[0]} rows; give one count per rank, in rank order"
        )
    return _AllToAll.apply(x, list(send), list(recv))


def capacity(tokens: int, num_experts: int, k: int, factor: float) -> int:
    """Assignments one expert takes from a group: ``ceil(factor * tokens * k / num_experts)``.

    Switch Transformer's ``tokens / num_experts * factor`` (Fedus et al. 2021, eq. 3, where
    ``k = 1``), counted in assignments and rounded up as Megatron-Core's ``get_capacity`` and
    DeepSpeed's ``_capacity`` do for top-k routing.
    """
    return math.ceil(factor * tokens * k / num_experts)


def keep_within_capacity(experts: torch.Tensor, num_experts: int, cap: int | None) -> torch.Tensor:
    """Which of the ``(token, choice)`` assignments fit in their expert's capacity.

    Args:
        experts: ``[tokens, k]`` expert chosen by each token, best choice first.
        num_experts: how many experts there are.
        cap: assignments each expert takes, or None for no limit.

    Returns:
        ``[tokens, k]`` booleans. Experts fill first with every token's first choice (in token
        order), then with second choices, so a second choice never displaces a first.
    """
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = nn.functional.one_hot(experts.t().reshape(-1), num_experts)  # choice-major order
    position = one_hot.cumsum(0).gather(1, experts.t().reshape(-1, 1)).squeeze(1)
    return (position <= cap).reshape(experts.t().shape).t()


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, ``N * sum_i f_i * P_i`` (arXiv:2101.03961).

    ``f_i`` is the fraction of the ``tokens * k`` assignments routed to expert i (before
    capacity), as Megatron-Core's ``switch_load_balancing_loss_func`` counts them (DeepSpeed's
    ``top2gating`` counts first choices only); ``P_i`` the router's mean probability for it.
    Switch's coefficient ``alpha`` is left to the caller. Uniform routing gives 1.0, which
    is not a lower bound: 2 experts, 90 tokens at probabilities (0.51, 0.49) and 10 at (0, 1)
    give 0.934. Only ``P`` carries a gradient (``f`` comes from an argmax).
    """
    num_experts = probs.shape[-1]
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    f = counts.to(probs.dtype) / experts.numel()
    return num_experts * (f * probs.mean(0)).sum()


def plan_dispatch(
    experts: torch.Tensor, keep: torch.Tensor, experts_per_rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Group this rank's kept assignments by the expert they go to.

    Returns:
        ``order``: the kept assignments' flat indices (``token * k + choice``) sorted by expert,
        so ranks' blocks are consecutive; ``per_expert``: assignments for each expert;
        ``send``: rows for each rank (``per_expert`` summed over each rank's experts).
    """
    flat = experts.reshape(-1)
    kept = keep.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    per_expert = torch.bincount(flat[kept], minlength=experts_per_rank * world)
    send = per_expert.reshape(world, experts_per_rank).sum(1).tolist()
    return order, per_expert, send


def _route(
    router: nn.Linear, x: torch.Tensor, k: int, capacity_factor: float | None
) -> dict[str, torch.Tensor]:
    probs = router(x).softmax(-1)
    weights, experts = probs.topk(k, dim=-1)
    num_experts = probs.shape[-1]
    cap = None
    if capacity_factor is not None:
        cap = capacity(x.shape[0], num_experts, k, capacity_factor)
    keep = keep_within_capacity(experts, num_experts, cap)
    return {"probs": probs, "weights": weights, "experts": experts, "keep": keep}


class MoE(nn.Module):
    """A mixture-of-experts layer in one process: router, top-k, capacity, weighted experts.

    Args:
        dim: token width. hidden: each expert's hidden width. num_experts: E. k: choices
        per token. capacity_factor: None for no capacity limit.

    Example:
        >>> moe = MoE(8, 16, num_experts=4, k=2)
        >>> y, aux = moe(torch.randn(10, 8))
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        k: int = 2,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Router probabilities, each token's top-k experts and weights, and what fits."""
        return _route(self.router, x, self.k, self.capacity_factor)

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and its auxiliary loss, each group of tokens routed on its own.

        ``groups`` splits the tokens as the ranks hold them, so capacity and the auxiliary
        loss (averaged over groups) match :class:`ExpertParallelMoE`.
        """
        outs, aux = [], []
        for chunk in x.chunk(groups):
            r = self.route(chunk)
            y = torch.zeros_like(chunk)
            for e, expert in enumerate(self.experts):
                token, choice = ((r["experts"] == e) & r["keep"]).nonzero(as_tuple=True)
                w = r["weights"][token, choice].unsqueeze(1)
                y = y.index_add(0, token, w * expert(chunk[token]))
            outs.append(y)
            aux.append(load_balancing_loss(r["probs"], r["experts"]))
        return torch.cat(outs), torch.stack(aux).mean()


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` on ranks: the router replicated, each rank holding ``E / R`` experts.

    Build it on every rank from the same ``MoE``: it shares that MoE's router and copies this
    rank's experts, so its parameters are what the rank holds. The router's gradient is this
    rank's part: all-reduce it with a sum (DDP would average: right only if each rank's loss is
    scaled by the world size). ``plan`` replaces
    :func:`plan_dispatch` (notebook 16's exercise). ``last`` keeps the latest forward's counts
    (``per_expert``, ``send``, ``recv``, ``dropped``) and the rows the dispatch brought
    (``arrived``: source rank 0's first, each source's by expert) for inspection.
    """

    def __init__(self, moe: MoE, plan: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if moe.num_experts % self.world:
            raise ValueError(f"{moe.num_experts} experts do not divide over {self.world} ranks")
        self.per_rank = moe.num_experts // self.world
        self.router, self.k, self.capacity_factor = moe.router, moe.k, moe.capacity_factor
        first = self.rank * self.per_rank
        self.experts = copy.deepcopy(moe.experts[first : first + self.per_rank])
        self.plan = plan or plan_dispatch
        self.last: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens through the layer: (output, auxiliary loss of these tokens)."""
        r = _route(self.router, x, self.k, self.capacity_factor)
        order, per_expert, send = self.plan(r["experts"], r["keep"], self.per_rank, self.world)
        per_expert, send = torch.as_tensor(per_expert, dtype=torch.long), [int(n) for n in send]
        incoming = torch.empty_like(per_expert)  # [sources * my experts] rows for each
        dist.all_to_all_single(incoming, per_expert)
        recv_per_expert = incoming.reshape(self.world, self.per_rank)
        recv = recv_per_expert.sum(1).tolist()

        token = order // self.k
        received = all_to_all(x[token], send, recv)
        local = torch.arange(self.per_rank).repeat(self.world)
        which = torch.repeat_interleave(local, recv_per_expert.reshape(-1))
        out = torch.zeros_like(received)
        for j, expert in enumerate(self.experts):
            rows = (which == j).nonzero().squeeze(1)
            out = out.index_copy(0, rows, expert(received[rows]))
        back = all_to_all(out, recv, send)

        weights = r["weights"].reshape(-1)[order].unsqueeze(1)
        y = torch.zeros_like(x).index_add(0, token, weights * back)
        self.last = {
            "per_expert": per_expert.tolist(),
            "send": send,
            "recv": recv,
            "dropped": int((~r["keep"]).sum()),
            "arrived": received.detach(),
        }
        return y, load_balancing_loss(r["probs"], r["experts"])
