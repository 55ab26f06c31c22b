"""torch's own Flight Recorder analyzer, run on the ranks' records, for a second opinion."""

from __future__ import annotations

import logging
from typing import Any


def run_torch_analyzer(records: dict[int, dict[str, Any]]) -> list[str]:
    """Run torch's own matcher (``torch.distributed.flight_recorder``) on the records.

    A gloo dump files its group in ``pg_config`` under an empty name while its entries name it
    ("0"), so the builder raises ``KeyError: ('0', 0)`` on it as it is (torch's
    ``flight_recorder/components/builder.py``, read in 2.14.1): ``pg_config`` is rebuilt here
    from the entries' names and the members each rank's record lists. Records it rejects are
    given to it again with ``gloo:`` read as ``nccl:``. The verdicts are a second opinion
    beside :func:`diagnose`'s: the analyzer stops pairing a group after its first mismatch,
    does not read ``pg_status`` (a rank behind looks like one whose oldest entries left the
    ring buffer), and knows nothing of ranks that returned from fn.
    """
    from argparse import Namespace

    try:
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

        log = FlightRecorderLogger().logger  # sets its level when first made
        level = log.level
        log.setLevel(logging.CRITICAL)  # it logs every mismatch (as errors), and tabulate missing
        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError as exc:
        return [f"not available in this torch ({exc})"]
    details: dict[str, dict[str, Any]] = {}
    version = ""
    for rank, record in records.items():
        trace = record.get("trace")
        if not trace or not trace.get("entries"):
            continue
        first_config: dict[str, Any] = next(iter(trace.get("pg_config", {}).values()), {})
        pg_ranks = first_config.get("ranks", "[]")
        config = {}
        for entry in trace["entries"]:
            name, desc = entry["process_group"]
            known = trace.get("pg_config", {}).get(name, {}).get("ranks", pg_ranks)
            members = (record.get("groups") or {}).get(name, {}).get("ranks")
            ranks = str(members) if members is not None else known
            config[name] = {"name": name, "desc": desc, "ranks": ranks}
        details[str(rank)] = {**trace, "pg_config": config, "rank": rank}
        version = trace.get("version", version)
    if len(details) < 2:
        log.setLevel(level)
        return []
    args = Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True)
    args.mismatch_cap = 10
    try:
        try:
            db = build_db(details, args, version)
        except AssertionError:  # torch 2.11-2.13 accept only nccl:/xccl: (components/types.py)
            renamed = _gloo_as_nccl(details)
            if renamed is None:
                raise
            db = build_db(renamed, args, version)
    except Exception as exc:
        return [f"could not read these records ({type(exc).__name__}: {exc})"]
    finally:
        log.setLevel(level)
    lines = []
    for coll in db.collectives:
        name = coll.collective_name.split(":", 1)[-1]
        if coll.missing_ranks:
            missing = ", ".join(map(str, sorted(coll.missing_ranks)))
            lines.append(f"{name} #{coll.collective_seq_id}: missing on rank(s) {missing}")
        for rank, other in sorted((coll.mismatch_collectives or {}).items()):
            lines.append(
                f"{name} #{coll.collective_seq_id}: rank {rank} "
                f"{other.type_of_mismatch.state.name if other.type_of_mismatch else 'differs'}"
            )
    return lines


def _gloo_as_nccl(details: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """The records with ``gloo:`` names read as ``nccl:`` (None: no gloo entry to rename)."""
    renamed, changed = {}, False
    for rank, trace in details.items():
        entries = []
        for entry in trace.get("entries", []):
            name = entry.get("profiling_name") or ""
            if name.startswith("gloo:"):
                entry = {**entry, "profiling_name": "nccl:" + name[len("gloo:") :]}
                changed = True
            entries.append(entry)
        renamed[rank] = {**trace, "entries": entries}
    return renamed if changed else None
