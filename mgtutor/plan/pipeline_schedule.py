"""A pipeline's step, played out: when each stage runs each micro-batch, so that the bubble and
the sends on the critical path come out of the schedule instead of a formula.

Without sends, a 1F1B or GPipe step of p equal stages is (m + p - 1) x (forward + backward), the
bubble (p-1)/(m+p-1) (Narayanan et al. 2021, arXiv:2104.04473, section 2.2.1), and with v model
chunks per GPU (p-1)/(v·m + p-1) (section 2.2.2). A send that takes d seconds from one stage to
the next changes that by less than 2·d per micro-batch: while one micro-batch's activation is
on the wire, the stages work on others. :func:`simulate` runs each stage's operations in the
schedule's order, each as soon as its input has arrived (a send starts when the operation that
produced it ends and lands d later; the sender does not wait), and returns when each stage
finishes. The orders are Megatron-LM's (``schedules.py``: ``forward_backward_pipelining_without
_interleaving`` and ``_with_interleaving``), which torch's ``Schedule1F1B``, ``ScheduleGPipe``
and ``ScheduleInterleaved1F1B`` follow.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["SCHEDULES", "order", "simulate"]

#: The schedules :func:`simulate` plays; "interleaved" needs chunks > 1.
SCHEDULES = ("1F1B", "GPipe", "interleaved")


def order(
    stage: int, stages: int, micro_batches: int, chunks: int = 1, schedule: str = "1F1B"
) -> list[tuple[str, int, int]]:
    """The operations of one stage (GPU) in the order it runs them: ("F" or "B", chunk,
    micro-batch). 1F1B: p - stage - 1 forwards first, then one forward and one backward in turn,
    then the remaining backwards; GPipe: every forward, then every backward; interleaved (v
    chunks): Megatron-LM's order, 2(p - stage - 1) + (v - 1)p forwards first."""
    p, m, v = stages, micro_batches, chunks
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "interleaved" and (v < 2 or m % p):
        raise ValueError(
            f"the interleaved schedule needs chunks > 1 and micro-batches ({m}) a multiple of "
            f"the stages ({p}), as Megatron-LM requires; got chunks={v}"
        )
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule} runs one chunk per stage, got chunks={v}")

    def unit(k: int, backward: bool) -> tuple[int, int]:  # (chunk, micro-batch) of the k-th op
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    total = m * v
    if schedule == "GPipe":
        warm = total
    elif schedule == "interleaved":
        warm = min((p - stage - 1) * 2 + (v - 1) * p, total)
    else:
        warm = min(p - stage - 1, total)
    ops = [("F", *unit(k, False)) for k in range(warm)]
    forwards, backwards = warm, 0
    while forwards < total or backwards < total:
        if forwards < total:
            ops.append(("F", *unit(forwards, False)))
            forwards += 1
        if backwards < total and (schedule != "GPipe" or forwards == total):
            ops.append(("B", *unit(backwards, True)))
            backwards += 1
    return ops


def simulate(
    forward: list[float],
    backward: list[float],
    micro_batches: int,
    send: float = 0.0,
    *,
    chunks: int = 1,
    schedule: str = "1F1B",
) -> list[float]:
    """When each stage ends its last operation, starting at 0.

    Args:
        forward, backward: seconds of one micro-batch's forward and backward on each stage (all
            its chunks together; a chunk takes 1/chunks of it).
        micro_batches: m.
        send: seconds from the end of an operation to its output's arrival at the next stage
            (activations forward, gradients backward); 0 within a stage.
        chunks: model chunks per stage (v), for the interleaved schedule.
        schedule: one of :data:`SCHEDULES`.

    Returns:
        Each stage's end time, in stage order.
    """
    p, v, m = len(forward), chunks, micro_batches
    orders = _orders(p, m, v, schedule)
    last = p * v - 1
    # End of each (virtual stage, micro-batch)'s forward and backward; -1: not run yet.
    ends = {"F": [[-1.0] * m for _ in range(p * v)], "B": [[-1.0] * m for _ in range(p * v)]}
    free, nxt = [0.0] * p, [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            ops, i, t = orders[r], nxt[r], free[r]
            while i < len(ops):
                kind, chunk, mb = ops[i]
                vs = chunk * p + r  # the virtual stage: chunk c of stage r
                if kind == "F":  # the previous virtual stage's forward, sent here
                    arrived, wire = (ends["F"][vs - 1][mb], send) if vs else (0.0, 0.0)
                    seconds = forward[r] / v
                else:  # the next virtual stage's backward, sent back; or this forward
                    arrived, wire = (
                        (ends["B"][vs + 1][mb], send) if vs < last else (ends["F"][vs][mb], 0.0)
                    )
                    seconds = backward[r] / v
                if arrived < 0:
                    break
                dep = arrived + wire
                t = max(t, dep) + seconds
                ends[kind][vs][mb] = t
                i += 1
            if i > nxt[r]:
                remaining -= i - nxt[r]
                nxt[r], free[r] = i, t
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule deadlocked: a bug in order()")
    return free


@lru_cache(maxsize=1)
def _orders(stages: int, micro_batches: int, chunks: int, schedule: str) -> tuple[tuple, ...]:
    """Every stage's :func:`order`, kept for the next call: ``step_time`` plays each pipeline
    twice (with its sends and without), and building the orders took a quarter of the time."""
    return tuple(tuple(order(r, stages, micro_batches, chunks, schedule)) for r in range(stages))
