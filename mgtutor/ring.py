"""The bytes one rank sends in a ring collective: the one formula the planner, the counts taken
in ranks and the simulated slow link share.

It imports nothing of mgtutor, so that :mod:`mgtutor.measure`, :mod:`mgtutor.plan` and
:mod:`mgtutor.parallel` can all use it.
"""

from __future__ import annotations

__all__ = ["RING_PASSES", "bytes_sent_on_ring"]

#: Passes of (N-1)/N of the buffer one rank sends, by collective: an all-reduce is a
#: reduce-scatter then an all-gather (2); a broadcast counts 1, on average over the ranks (N-1
#: of them receive the buffer once).
RING_PASSES = {
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_to_all": 1,
    "broadcast": 1,
}


def bytes_sent_on_ring(name: str, size: int, nbytes: int, *, calls: int = 1, every: int = 1) -> int:
    """Bytes one rank sends for ``calls`` ring collectives on ``size`` ranks, per ``every`` steps.

    The convention: ``nbytes`` is the whole buffer (an all-reduce's or a broadcast's tensor, an
    all-gather's output, a reduce-scatter's input); each pass sends (N-1)/N of it, and
    :data:`RING_PASSES` says how many passes. The result is rounded down once, after
    multiplying by ``calls`` and dividing by ``every``.

    ``every`` is the steps the calls are spread over (LocalSGD's and DiLoCo's ``sync_every``).
    ValueError if ``name`` is not a key of :data:`RING_PASSES`.
    """
    if name not in RING_PASSES:
        raise ValueError(f"{name!r} is not a ring collective: one of {sorted(RING_PASSES)}")
    return calls * RING_PASSES[name] * (size - 1) * nbytes // (size * every)
