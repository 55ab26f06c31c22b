"""Context parallelism by hand: ring attention, the log-sum-exp merge, the zig-zag split.

Each rank holds a block of the sequence: its queries, keys and values. Attention needs every
query against every key, so the key-value blocks travel round a ring of ranks, one step at a
time, and each rank attends its queries to the block it holds. The partial results of the
blocks are combined exactly with their log-sum-exps (:func:`merge_partials`), so the output
equals full attention. With a causal mask the contiguous split gives the last rank the most
work; the zig-zag split (:func:`split_zigzag`) gives every rank the same.
:func:`ulysses_attention` splits by head instead, and
:func:`mgtutor.parallel.comms.record_comms` records what each design sends, as it runs.

A rank's *layout* is the global positions of its rows: :func:`split_contiguous` and
:func:`split_zigzag` give every rank's, and every rank passes all of them to
:func:`ring_attention`, so it knows where each block it receives sits in the sequence.

Example (inside a rank)::

    layout = split_zigzag(seq_len, world_size)
    mine = layout[rank]
    out = ring_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], layout)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "attention_with_lse",
    "merge_partials",
    "needed_block",
    "ring_attention",
    "split_contiguous",
    "split_zigzag",
    "ulysses_attention",
]

Merge = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def split_contiguous(seq_len: int, world_size: int) -> list[Tensor]:
    """Rank r holds positions ``r * n .. (r + 1) * n - 1``, ``n = seq_len / world_size``."""
    if seq_len % world_size:
        raise ValueError(f"seq_len {seq_len} must divide by world_size {world_size}")
    return list(torch.arange(seq_len).chunk(world_size))


def split_zigzag(seq_len: int, world_size: int) -> list[Tensor]:
    """Cut the sequence in ``2 * world_size`` chunks; rank r holds chunk r and chunk 2w-1-r.

    Under a causal mask an early chunk sees few keys and a late one many: pairing them gives
    every rank the same number of query-key pairs (torch calls this the head-tail order).
    """
    if seq_len % (2 * world_size):
        raise ValueError(
            f"seq_len {seq_len} must divide by 2 * world_size = {2 * world_size} for the "
            "zig-zag split (two equal chunks per rank)"
        )
    chunks = torch.arange(seq_len).chunk(2 * world_size)
    return [torch.cat([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]


def needed_block(q_pos: Tensor, k_pos: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """The rows (queries) that see some key and the columns (keys) some query sees.

    Under a causal mask query i sees key j when ``j <= i``. A rank computes only this rectangle
    of a block: nothing when a block is wholly in the future, half when half of it is.
    """
    if not causal:
        return torch.arange(len(q_pos)), torch.arange(len(k_pos))
    rows = torch.nonzero(q_pos >= k_pos.min()).flatten()
    cols = torch.nonzero(k_pos <= q_pos.max()).flatten()
    return rows, cols


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain attention of ``q`` over one block of keys, with each row's log-sum-exp.

    Args:
        q: queries, ``(..., Lq, D)``; k, v: one block of keys and values, ``(..., Lk, D)``.
        q_pos, k_pos: global positions of the rows; given, a causal mask applies.
        scale: multiplies the scores; ``1 / sqrt(D)`` by default, as SDPA.

    Returns:
        ``out`` ``(..., Lq, D)``, the softmax over this block only, and ``lse`` ``(..., Lq)``,
        the log of the sum of the block's exponentiated scores. A row that sees no key of the
        block gets ``out`` 0 and ``lse`` ``-inf``: it holds no weight in a merge.
    """
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if q_pos is not None and k_pos is not None:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)  # so that a masked row gives 0, not NaN
    return torch.exp(scores - finite.unsqueeze(-1)) @ v, lse


def merge_partials(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint blocks of keys into attention over both.

    ``out_a`` is ``softmax`` over block a, normalized by ``exp(lse_a)``; over both blocks the
    normalizer is ``exp(lse_a) + exp(lse_b)``, so ``lse = log(exp(lse_a) + exp(lse_b))`` and
    each part is weighted by ``exp(lse_part - lse)``, computed without overflow. Rows where
    both are ``-inf`` (no key seen yet) stay 0 with ``lse`` ``-inf``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(torch.isinf(lse), 0.0)
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: list[Tensor],
    *,
    causal: bool = True,
    merge: Merge = merge_partials,
    trace: list[dict] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Attention of this rank's queries over every rank's keys, the keys travelling a ring.

    Forward, ``world_size - 1`` steps: each rank sends the key-value block it holds to rank
    ``rank + 1`` and receives one from ``rank - 1`` (started before it computes, so the message
    overlaps the work), attends its queries to the block it holds, and merges with
    :func:`merge_partials`. Backward (autograd calls it): the blocks go round again, each sent
    before the step's work as in forward; the key and value gradients accumulated for a block
    follow it, each sent after the step's work, one step more, so that each block's gradients
    arrive home; each rank keeps its query gradients.

    Args:
        q, k, v: this rank's rows, ``(..., L / world_size, D)``.
        layout: every rank's global positions, from :func:`split_contiguous` or
            :func:`split_zigzag`; this rank's rows are ``layout[rank]``.
        causal: mask keys after each query.
        merge: the rule that combines partial results (the notebook's exercise swaps in yours).
        trace: a list to append one dict per forward step to: ``source`` (whose block, by
            the ring's own arithmetic), ``pairs`` (query-key pairs, from
            :func:`needed_block`), ``compute_s`` and ``wait_s`` (wall-clock seconds computing,
            then waiting for the next block) and ``compute_cpu_s`` (this process's CPU seconds
            computing, which other processes on the machine inflate less).
        group: the ring's process group; the default group if None.

    Returns:
        This rank's attention output, ``(..., L / world_size, D)``.
    """
    return _RingAttention.apply(q, k, v, layout, causal, merge, trace, group)


def _exchange(held: Tensor, group: dist.ProcessGroup | None, tag: int = 0) -> tuple[Tensor, list]:
    """Send ``held`` to the next rank and receive the previous rank's; returns (buffer, work)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    incoming = torch.empty_like(held)
    return incoming, [dist.isend(held, right, group, tag), dist.irecv(incoming, left, group, tag)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layout: list[Tensor],
        causal: bool,
        merge: Merge,
        trace: list[dict] | None,
        group: dist.ProcessGroup | None,
    ) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        q_pos, scale = layout[rank], 1 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        held = torch.stack([k, v])
        for step in range(world):
            source = (rank - step) % world
            start, start_cpu = time.perf_counter(), time.process_time()
            if step < world - 1:
                incoming, work = _exchange(held, group)
            k_pos = layout[source]
            rows, cols = needed_block(q_pos, k_pos, causal)
            if len(rows):
                masks: tuple[Tensor | None, Tensor | None] = (
                    (q_pos[rows], k_pos[cols]) if causal else (None, None)
                )
                part = attention_with_lse(
                    q[..., rows, :], held[0][..., cols, :], held[1][..., cols, :], *masks, scale
                )
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *part)
            computed, computed_cpu = time.perf_counter(), time.process_time()
            if step < world - 1:
                for request in work:
                    request.wait()
                held = incoming
            if trace is not None:
                trace.append(
                    {
                        "source": source,
                        "pairs": len(rows) * len(cols),
                        "compute_s": computed - start,
                        "compute_cpu_s": computed_cpu - start_cpu,
                        "wait_s": time.perf_counter() - computed,
                    }
                )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal, ctx.group, ctx.scale = layout, causal, group, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        q_pos = ctx.layout[rank]
        grad_q = torch.zeros_like(q)
        delta = (grad_out * out).sum(-1, keepdim=True)  # d(softmax) needs sum(dO * O) per row
        # Two messages travel: a block's keys and values, sent ahead of each step's work as in
        # forward, and the gradients accumulated for that block so far, sent after it.
        incoming_held = torch.stack([k, v])
        incoming_grads = torch.zeros_like(incoming_held)
        held_work: list[dist.Work] = []
        grads_work: list[dist.Work] = []
        for step in range(world):
            for request in held_work:
                request.wait()
            held = incoming_held
            if step < world - 1:
                incoming_held, held_work = _exchange(held, group)
            k_pos = ctx.layout[(rank - step) % world]
            rows, cols = needed_block(q_pos, k_pos, ctx.causal)
            if len(rows):
                qq, kk, vv = q[..., rows, :], held[0][..., cols, :], held[1][..., cols, :]
                scores = qq @ kk.transpose(-2, -1) * scale
                if ctx.causal:
                    masked = k_pos[cols][None, :] > q_pos[rows][:, None]
                    scores = scores.masked_fill(masked, -math.inf)
                probs = torch.exp(scores - lse[..., rows].unsqueeze(-1))  # the final softmax
                g = grad_out[..., rows, :]
                d_scores = probs * (g @ vv.transpose(-2, -1) - delta[..., rows, :])
                grad_q[..., rows, :] += d_scores @ kk * scale
                grad_k = d_scores.transpose(-2, -1) @ qq * scale
                grad_v = probs.transpose(-2, -1) @ g
            for request in grads_work:  # this block's gradients so far: needed only now
                request.wait()
            grads = incoming_grads
            if len(rows):
                grads[0][..., cols, :] += grad_k
                grads[1][..., cols, :] += grad_v
            if world > 1:  # after the last step, each block's gradients go home
                incoming_grads, grads_work = _exchange(grads, group, tag=1)
        for request in grads_work:
            request.wait()
        grads = incoming_grads
        return grad_q, grads[0], grads[1], None, None, None, None, None


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: list[Tensor],
    *,
    causal: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Attention by head instead of by block: DeepSpeed-Ulysses (Jacobs et al., arXiv:2309.14509).

    One all-to-all turns each of q, k and v from "my tokens, every head" into "every token, my
    ``heads / world_size`` heads"; each rank runs whole-sequence attention for its heads; one
    all-to-all turns the output back. Forward only (it is here to be counted, not trained).

    Args:
        q, k, v: this rank's rows, ``(batch, heads, L / world_size, D)``; heads must divide
            by the world size.
        layout: every rank's global positions, as for :func:`ring_attention`.
        causal: mask keys after each query.
        group: the process group; the default group if None.

    Returns:
        This rank's attention output, ``(batch, heads, L / world_size, D)``.
    """
    world = dist.get_world_size(group)
    batch, heads, rows, dim = q.shape
    if heads % world:
        raise ValueError(f"{heads} heads do not divide by {world} ranks: Ulysses splits heads")

    def to_heads(t: Tensor) -> Tensor:
        send = t.reshape(batch, world, heads // world, rows, dim).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)  # recv[i]: rank i's tokens, this rank's heads
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * rows, dim)

    positions = torch.cat(layout)  # the global position of every gathered row
    masks = (positions, positions) if causal else (None, None)
    out, _ = attention_with_lse(to_heads(q), to_heads(k), to_heads(v), *masks)
    send = out.reshape(batch, heads // world, world, rows, dim).permute(2, 0, 1, 3, 4)
    recv = torch.empty_like(send.contiguous())  # recv[j]: this rank's tokens, rank j's heads
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv.transpose(0, 1).reshape(batch, heads, rows, dim)
