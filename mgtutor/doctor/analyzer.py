"""torch's own Flight Recorder analyzer, run on the ranks' records, for a second opinion."""

from __future__ import annotations

import logging
from typing import Any


def run_torch_analyzer(records: dict[int, dict[str, Any]]) -> list[str]:
    """Run torch's own matcher (``torch.distributed.flight_recorder``) on the records.

    Its builder looks up each entry's group by ``(entry["process_group"][0], rank)`` in a table
    made from the dump's ``pg_config``. A gloo dump of torch 2.14 files its group in
    ``pg_config`` under an empty name and description while its entries name it ("0",
    "default_pg"), hence the ``KeyError: ('0', 0)`` it raises on gloo dumps as they are. The
    ``pg_config`` is rebuilt here from the entries' names and the members each rank's record
    lists. The matching for the message is
    written out in :func:`diagnose` anyway: the analyzer reports through logging and stops
    pairing a group after its first mismatch, does not read ``pg_status`` (so it cannot tell
    a rank that is behind from one whose oldest entries left the ring buffer), and knows
    nothing of ranks that returned from fn. Its verdicts are kept next to the diagnosis.

    torch 2.11's analyzer (``components/types.py``, ``Op``) accepts only ``nccl:`` and ``xccl:``
    names and stops on gloo's (2.14 added ``gloo``). The prefix only names the library: the
    matching reads the operation after it (torch 2.15's ``types.py`` says so and accepts any
    prefix). When the analyzer rejects the records as they are, they are given to it again with
    ``gloo:`` read as ``nccl:``.
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
        except AssertionError:
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
