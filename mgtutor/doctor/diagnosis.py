"""Compare the ranks' records and say in plain words which rank diverged, where and how.

A hang in data-parallel training is almost always a *desync*: the ranks did not call the same
collectives in the same order with the same tensors. Read side by side, per process group, the
records name the rank that did not call a collective its peers wait in, and the collectives
whose operation, shapes or dtypes differ. What the records cannot show, the ranks' stacks
do: a point-to-point call (gloo records no send or recv), or ranks that wait in collectives of
different groups, each for the other.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from mgtutor.doctor.analyzer import run_torch_analyzer
from mgtutor.doctor.reading import (
    GroupView,
    as_record,
    entry_where,
    group_label,
    group_views,
    left_no_record,
    op_name,
    record_notes,
    shape,
    stack_call,
    user_frame,
    where,
    wrapped,
)
from mgtutor.doctor.record import P2P_CALLS

__all__ = ["Diagnosis", "diagnose"]

_LAST = 10**9  # problems without a sequence number sort after every collective


@dataclass
class Diagnosis:
    """What the ranks' records say went wrong.

    Attributes:
        summary: one line in plain words (empty problems: the records agree).
        details: further lines: every difference found, where each rank was, torch's analyzer.
        kind: "raised", "finished", "behind", "order", "operation", "shape", "dtype", "p2p",
            "missing_record", "no_recorder" or "agree".
        ranks: the ranks the summary blames.
        seq: the collective's sequence number in its process group (None if not one).
        records: the raw records, rank -> record, for whoever wants to look; a rank that left
            none has a placeholder (``trace`` None, ``from_peers`` True) with the process
            groups its peers' records give it.
        analyzer: what torch's analyzer (``torch.distributed.flight_recorder``) found, one line
            per collective it could not match, or why it could not run.
    """

    summary: str
    details: list[str] = field(default_factory=list)
    kind: str = "agree"
    ranks: list[int] = field(default_factory=list)
    seq: int | None = None
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    analyzer: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([self.summary, *("  " + line for line in self.details)])


@dataclass
class _Problem:
    seq: int
    kind: str
    ranks: list[int]
    head: str
    more: str = ""
    group: str = ""
    waiters: list[int] = field(default_factory=list)  # for a missing collective: who waits
    op: str = ""  # for a missing collective: "all_reduce #2 (process group 1)"


def _missing(
    name: str,
    seq: int,
    per_rank: dict[int, GroupView],
    records: dict[int, dict[str, Any]],
    finished: Collection[int],
    raised: Mapping[int, str],
    work: str = "fn",
) -> list[_Problem]:
    """Ranks that never enqueued collective ``seq`` of group ``name`` while others did."""
    reached = sorted(r for r, v in per_rank.items() if v.last >= seq)
    lacking = sorted(r for r, v in per_rank.items() if v.last < seq)
    if not reached or not lacking:
        return []
    with_entry = [r for r in reached if seq in per_rank[r].by_seq]
    entry = per_rank[with_entry[0]].by_seq[seq] if with_entry else None
    op = f"{op_name(entry)} #{seq}" if entry else f"collective #{seq}"
    op += group_label(name)
    waiters = [r for r in reached if per_rank[r].waiting() == seq] or reached
    place = entry_where(records[with_entry[0]], entry) if with_entry else ""
    who = " and ".join(f"rank {r}" for r in waiters)
    verb = "is" if len(waiters) == 1 else "are"
    target = f"{op}, which {who} {verb} waiting in" + (f" ({place})" if place else "")
    problems = []
    for r in lacking:
        view, record = per_rank[r], records[r]
        last = view.by_seq.get(view.last)
        if view.last and last:
            more = f"rank {r}'s last collective{group_label(name)} was {op_name(last)} #{view.last}"
            more += f" ({w})" if (w := entry_where(record, last)) else ""
        elif view.last:
            more = f"rank {r}'s last collective{group_label(name)} was #{view.last}"
        else:
            more = f"rank {r} called no collective{group_label(name)}"
        if r in raised:
            here = where(user_frame(record.get("stack") or []))
            at = f" ({here})" if here else ""
            head = f"rank {r} raised {raised[r]}{at} before it reached {target}"
            kind = "raised"
        elif r in finished:
            head = f"rank {r} returned from {work} without calling {target}"
            kind = "finished"
        else:
            head = f"rank {r} never reached {target}"
            kind = "behind"
            call, here = stack_call(record)
            if here:
                more += f"; it is now in {call} at {here}" if call else f"; it is now at {here}"
        if not entry:
            oldest = min(per_rank[reached[0]].by_seq, default=seq + 1)
            why = "dropped it (a partial record)" if seq < oldest else "does not hold it yet"
            more += f"; rank {reached[0]}'s record counts #{seq} but {why}"
        problems.append(_Problem(seq, kind, [r], head, more, name, waiters, op))
    return problems


# Ranks may pass different shapes: all_to_all_single with uneven splits (gloo's "all_to_all").
_SIZES_MAY_DIFFER = frozenset({"all_to_all", "alltoall", "alltoall_base"})
# Collectives whose list of tensors only the root passes: the other ranks record no input at all.
_ROOT_ONLY_INPUTS = frozenset({"scatter", "gather"})


def _different(
    name: str, seq: int, have: dict[int, dict[str, Any]], records: dict[int, dict[str, Any]]
) -> _Problem | None:
    """The first of operation, shapes, dtypes that differs between the ranks' entry ``seq``."""
    first = min(have)
    group = group_label(name)
    kinds: tuple[str, ...] = ("operation", "shape", "dtype")
    if op_name(have[first]) in _SIZES_MAY_DIFFER:
        kinds = ("operation", "dtype")
    elif op_name(have[first]) in _ROOT_ONLY_INPUTS:
        kinds = ("operation",)
    for kind in kinds:
        if kind == "operation":
            values = {r: op_name(e) for r, e in have.items()}
        elif kind == "shape":
            values = {r: str(e.get("input_sizes")) for r, e in have.items()}
        else:
            values = {r: str(e.get("input_dtypes")) for r, e in have.items()}
        if len(set(values.values())) == 1:
            continue
        odd = sorted(r for r in have if values[r] != values[first])
        listing = ", ".join(f"rank {r} {op_name(e)} {shape(e)}" for r, e in sorted(have.items()))
        if kind == "operation":
            calls = ", ".join(f"rank {r} {values[r]}" for r in sorted(have))
            head = f"ranks called different collectives as #{seq}{group}: {calls}"
        else:
            word = "shapes" if kind == "shape" else "dtypes"
            head = f"{op_name(have[first])} #{seq}{group} got different {word}: {listing}"
        places = {r: entry_where(records[r], e) for r, e in sorted(have.items())}
        if len(set(places.values())) == 1 and len(places) > 1:
            more = f"every rank issued it at {places[first]}" if places[first] else ""
        else:
            more = "; ".join(f"rank {r} issued it at {w}" for r, w in places.items() if w)
        return _Problem(seq, kind, odd, head, more, name)
    return None


def _compare_group(
    name: str,
    per_rank: dict[int, GroupView],
    records: dict[int, dict[str, Any]],
    finished: Collection[int],
    raised: Mapping[int, str],
    work: str = "fn",
) -> list[_Problem]:
    # A ring buffer may have dropped a rank's oldest entries: compare entries where every rank
    # has them, and look for a missing collective from the counters, which nothing drops.
    start = max(min(v.by_seq) if v.by_seq else v.last + 1 for v in per_rank.values())
    top = max(v.last for v in per_rank.values())
    if top <= 0:
        return []
    first_missing = min(v.last for v in per_rank.values()) + 1
    problems: list[_Problem] = []
    blamed: set[int] = set()
    for seq in range(min(start, top, first_missing), top + 1):
        missing = _missing(name, seq, per_rank, records, finished, raised, work)
        fresh = [p for p in missing if p.ranks[0] not in blamed]
        problems += fresh
        blamed.update(p.ranks[0] for p in missing)
        if missing:
            continue
        have = {r: v.by_seq[seq] for r, v in per_rank.items() if seq in v.by_seq}
        if len(have) > 1 and (found := _different(name, seq, have, records)):
            problems.append(found)
    return problems


def _cross_group(problems: list[_Problem], records: dict[int, dict[str, Any]]) -> _Problem | None:
    """Ranks that each wait in a collective of a group the other has not reached yet."""
    behind = [p for p in problems if p.kind == "behind"]
    blamed = {p.ranks[0] for p in behind}
    waiting = {(w, p.group, p.seq) for p in behind for w in p.waiters}
    if len({p.group for p in behind}) < 2 or not blamed <= {w for w, _, _ in waiting}:
        return None
    parts = []
    for rank, group, _ in sorted(waiting):
        problem = next(p for p in behind if p.group == group and rank in p.waiters)
        _, place = stack_call(records[rank])
        op = problem.op + (" (default group)" if group == "0" else "")
        parts.append(f"rank {rank} in {op}" + (f" at {place}" if place else ""))
    ranks = sorted({w for w, _, _ in waiting})
    return _Problem(
        min(p.seq for p in behind),
        "order",
        ranks,
        "the ranks wait in collectives of different process groups, each for another: "
        + "; ".join(parts),
        "sequence numbers count per group, so no rank is behind: the ranks called the groups' "
        "collectives in different orders. Call them in the same order on every rank",
    )


def _point_to_point(
    records: dict[int, dict[str, Any]],
    finished: Collection[int],
    raised: Mapping[int, str],
    work: str = "fn",
) -> _Problem | None:
    """A rank whose stack is in send or recv: the stacks say what the records cannot."""
    for rank, record in sorted(records.items()):
        call = record.get("call") or {}
        if call.get("name") not in P2P_CALLS:
            continue
        _, place = stack_call(record)
        peer = next((call[k] for k in ("src", "dst") if isinstance(call.get(k), int)), None)
        word = "from" if "recv" in call["name"] else "to"
        head = f"rank {rank} waits in {call['name']}" + (
            f" {word} rank {peer}" if peer is not None else ""
        )
        head += f" ({place})" if place else ""
        more = (
            "a point-to-point call: gloo's recorder (torch 2.14) does not record send and recv, "
            "so this comes from the rank's stack"
        )
        if peer in finished:
            more += f"; rank {peer} returned from {work}"
        elif peer is not None and peer in raised:
            more += f"; rank {peer} raised {raised[peer]}"
        elif peer in records:
            peer_call, peer_place = stack_call(records[peer])
            if peer_place:
                more += f"; rank {peer} is " + (f"in {peer_call} " if peer_call else "")
                more += f"at {peer_place}"
        return _Problem(_LAST - 1, "p2p", [rank] if peer is None else [peer], head, more)
    return None


def diagnose(
    dumps: Mapping[int, Any],
    *,
    finished: Collection[int] = (),
    raised: Mapping[int, str] | None = None,
    world_size: int | None = None,
    work: str = "fn",
) -> Diagnosis:
    """Compare the ranks' records and say in plain words which rank diverged, and how.

    The first difference, in sequence order, is the cause; what follows it is a consequence.
    Differences found, per process group (its members come from the records, so a rank that
    never called a group's collective counts): a rank that never reached a collective its
    peers are in ("raised" when that rank raised, "finished" when it returned from fn,
    "behind" when it is alive elsewhere), ranks waiting in collectives of different groups
    ("order"), a different operation for the same sequence number, different input shapes,
    different dtypes, a rank waiting in send or recv ("p2p", from its stack), and ranks with
    no record (dead, or their torch has no recorder).

    Args:
        dumps: rank -> that rank's record: a :func:`~mgtutor.doctor.own_dump` dict, the bytes a
            responder wrote, or torch's own ``_dump_fr_trace()`` bytes or dict.
        finished: ranks known to have returned from fn.
        raised: rank -> ``"ValueError: message"`` for ranks known to have raised.
        world_size: the number of ranks, if some may be missing from ``dumps``.
        work: what the ranks ran, as "returned from ..." ends ("fn"; "the %%ddp cell").

    Returns:
        A :class:`Diagnosis`; ``str()`` of it is the message for the learner.

    Example:
        >>> print(diagnose({0: rank0_record, 1: rank1_record}, finished={1}))
        rank 1 returned from fn without calling all_reduce #2, which rank 0 is waiting in (...)
    """
    raised = dict(raised or {})
    records = {int(r): as_record(int(r), d) for r, d in dumps.items()}
    ranks = sorted(records)
    size = world_size or (max(ranks) + 1 if ranks else 0)
    absent = [r for r in range(size) if r not in records]
    no_trace = [r for r in ranks if records[r]["trace"] is None]
    if no_trace and len(no_trace) == len(ranks):
        why = records[no_trace[0]].get("error") or "no record"
        return Diagnosis(
            f"no collective record from any rank: {why}",
            kind="no_recorder",
            ranks=no_trace,
            records=records,
        )
    views = group_views(records, size)
    problems: list[_Problem] = []
    for name in sorted(views, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else 0, n)):
        if len(views[name]) > 1:
            problems += _compare_group(name, views[name], records, finished, raised, work)
    order = _cross_group(problems, records)
    if order is not None:  # it replaces the "behind" it is made of: no rank is behind
        problems = [order, *(p for p in problems if p.kind != "behind")]
    if not problems and (p2p := _point_to_point(records, finished, raised, work)):
        problems.append(p2p)
    placeholders = {}
    for r in absent:
        head, placeholders[r] = left_no_record(r, records, views, size)
        problems.append(_Problem(_LAST, "missing_record", [r], head))
    for r in no_trace:
        why = records[r].get("error") or "no record"
        problems.append(_Problem(_LAST, "missing_record", [r], f"no record from rank {r}: {why}"))
    notes = record_notes(records, views)
    analyzer = run_torch_analyzer(records)
    if not problems:
        partial = " (from partial records)" if any(wrapped(r) for r in records.values()) else ""
        return Diagnosis(
            f"the ranks' records agree: same collectives, same order, same shapes{partial}",
            details=notes,
            records=records,
            analyzer=analyzer,
        )
    problems.sort(key=lambda p: (p.seq, p.kind != "order"))
    first = problems[0]
    details = [first.more] if first.more else []
    details += [p.head + (f" ({p.more})" if p.more else "") for p in problems[1:]]
    details += notes
    if absent and first.kind != "missing_record":
        details.append(
            "ranks with no record (they died, e.g. gloo ends a rank that receives more bytes "
            "than it expects, or did not answer): " + ", ".join(map(str, absent))
        )
    details += [f"torch's analyzer: {line}" for line in analyzer]
    return Diagnosis(
        first.head,
        details=details,
        kind=first.kind,
        ranks=first.ranks,
        seq=None if first.seq >= _LAST - 1 else first.seq,
        records={**records, **placeholders},
        analyzer=analyzer,
    )
