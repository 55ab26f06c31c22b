"""The orders a pipeline's stages run, and the ticks they take, without any process.

* :func:`gpipe_order` and :func:`one_f_one_b_order` are the two classic schedules, as the list
  of actions each stage runs.
* :func:`tick_table` plays them with one tick per action, which gives the bubble exactly;
  :func:`replay_ticks` plays any schedule's per-rank actions (several stages per rank, split
  backwards) the same way, e.g. torch's interleaved 1F1B.
* :func:`bubble_fraction` is the formula the tables match; :func:`max_in_flight` counts the
  micro-batches an order keeps in flight.

:mod:`.pipeline` runs these orders on ranks (and re-exports every name here); this module is
pure Python, so a reader can play with schedules with no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "Action",
    "Length",
    "Step",
    "bubble_fraction",
    "gpipe_order",
    "max_in_flight",
    "one_f_one_b_order",
    "replay_ticks",
    "tick_table",
]

Action = tuple[str, int]  # ("F", micro-batch) or ("B", micro-batch)


def gpipe_order(n_micro: int) -> list[Action]:
    """GPipe: every micro-batch forward, then every one backward (the same on every stage)."""
    return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]


def one_f_one_b_order(stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """1F1B: ``n_stages - 1 - stage`` forwards to fill the pipe, then one forward and one
    backward in turn, then the backwards left (as torch's ``Schedule1F1B``)."""
    warmup = min(n_stages - 1 - stage, n_micro)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, n_micro):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(n_micro - warmup, n_micro)]


Length = Callable[[int, str], int]  # (stage, kind) -> how many ticks the action lasts


def tick_table(
    orders: Sequence[Sequence[Action]], length: Length | None = None
) -> list[list[Action | None]]:
    """:func:`replay_ticks` with one stage per rank: what each stage runs at each tick, None when
    idle (the bubble). ``F`` i on stage s waits for ``F`` i on stage s - 1, ``B`` i for ``B`` i on
    stage s + 1 (the last stage's for its own ``F``). ValueError if the orders deadlock."""
    ticks = replay_ticks(
        [[(s, kind, i) for kind, i in o] for s, o in enumerate(orders)], len(orders), length
    )
    return [[None if a is None else a[1:] for a in row] for row in ticks]


Step = tuple[int, str, int]  # (stage, kind, micro-batch), kind "F", "B", "I" or "W"


def replay_ticks(
    orders: Sequence[Sequence[Step]], n_stages: int, length: Length | None = None
) -> list[list[Step | None]]:
    """Play each rank's actions, one tick each, as early as the data allows (free messages).

    A rank may run several stages (interleaved and V schedules). ``F`` of micro-batch i on
    stage s waits for ``F`` i on stage s - 1; ``B`` (full backward) or ``I`` (input gradient)
    i on stage s for ``B`` or ``I`` i on stage s + 1, the last stage's for its own ``F``; ``W``
    (weight gradient) i for ``I`` i on the same stage. A rank runs its actions in its order.
    ``length(stage, kind)``, if given, is how many ticks (1 or more) an action fills in its
    row; what waits for it waits for its last.

    Returns:
        One row per rank: what it runs at each tick, None when idle.

    Raises:
        ValueError: the orders wait for each other forever (a deadlock).
    """
    n = len(orders)
    done: dict[tuple[int, str, int], int] = {}  # (stage, "F"/"B"/"W", mb): its last tick
    rows: list[list[Step | None]] = [[] for _ in range(n)]
    position, tick, busy_until = [0] * n, 0, [-1] * n
    while any(position[r] < len(orders[r]) or busy_until[r] >= tick for r in range(n)):
        ran = False
        for r in range(n):
            if busy_until[r] >= tick:  # still running the action it started
                rows[r].append(rows[r][-1])
                ran = True
                continue
            if position[r] == len(orders[r]):
                rows[r].append(None)
                continue
            s, kind, i = orders[r][position[r]]
            need = {
                "F": (s - 1, "F", i) if s > 0 else None,
                "W": (s, "B", i),
            }.get(kind, (s + 1, "B", i) if s < n_stages - 1 else (s, "F", i))
            if need is None or done.get(need, tick) < tick:
                rows[r].append((s, kind, i))
                busy_until[r] = tick + (1 if length is None else length(s, kind)) - 1
                done[(s, "B" if kind == "I" else kind, i)] = busy_until[r]
                position[r] += 1
                ran = True
            else:
                rows[r].append(None)
        if not ran:
            raise ValueError(f"the orders deadlock at tick {tick}: positions {position}")
        tick += 1
    while all(row and row[-1] is None for row in rows):
        for row in rows:
            row.pop()
    return rows


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """The idle share of a GPipe or 1F1B step with equal stages (a backward need not take a
    forward's time) and free messages: ``(p - 1) / (m + p - 1)``, on every stage."""
    return (n_stages - 1) / (n_micro + n_stages - 1)


def max_in_flight(order: Sequence[Action]) -> int:
    """The most micro-batches forwarded and not yet backward at once, in this order."""
    live, most = 0, 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most
