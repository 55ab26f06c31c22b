"""How far do the step-time check's real configurations land from their predictions, run to run?

What it measures
    ``mgtutor.experiments.step_check`` holds each real configuration (one process, DDP, TP and, from
    torch 2.5, a 2-stage ``Schedule1F1B``: GPT layers on 2 gloo CPU ranks) to within a factor
    ``step_check.FACTOR``. A run is what tests/experiments/test_step_check.py and notebook 18 do: a
    fresh ``mgtutor.Pool(2, backend="gloo")``, ``calibrate_beside`` (every figure the median of
    ``passes``), and ``check`` of those configurations (``rounds=2``, the configurations
    interleaved). Each run's error ((predicted - measured median) / measured median) is a new draw
    of the calibration's and the steps' noise; the script prints, per configuration, the median,
    the range and how many runs fell outside the bound. It is the evidence for the bound: a bound
    inside this range fails on a quiet machine; one far outside it checks less than it could.

    ``--scale F`` also checks each run's configurations against the same calibration with every
    compute rate F times too fast (``step_calibrate.scaled(hardware, F)``: products, memory-bound
    operations and the copy; not gloo's links), measured again in the same pool: the
    counterfactual of a compute model that is wrong by F. It prints how many runs that check fails
    per configuration, which is what the bound can catch.

Run it alone on an otherwise idle machine: ``python benchmarks/step_check_spread.py`` (12 runs;
about 5 minutes on 2 cores, twice that with ``--scale``). Runs where other work crowded the ranks
or the calibration (``Measured.asserted`` false) are counted apart: the check does not assert them.
The JSON file (``--out``) keeps every run: each configuration's prediction, measured steps,
error, crowding, the settings (passes, window) and ``_machine.machine()``'s record.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _machine import machine  # noqa: E402


def _row(m: object) -> dict:
    return {"predicted": m.predicted.total, "seconds": m.seconds, "error": m.error,  # type: ignore[attr-defined]
            "crowding": m.crowding, "calibration": m.calibration,  # type: ignore[attr-defined]
            "asserted": m.asserted, "holds": m.holds}  # type: ignore[attr-defined]  # fmt: skip


def _table(title: str, runs: list[dict], key: str, names: tuple[str, ...]) -> None:
    print(f"\n{title}\n")
    print("| configuration | runs asserted | median error | range | outside the bound |")
    print("|---|---|---|---|---|")
    for name in names:
        rows = [r[key][name] for r in runs if key in r]
        held = [row for row in rows if row["asserted"]]
        e = [row["error"] for row in held]
        crowded = len(rows) - len(e)
        if not e:
            print(f"| {name} | 0 ({crowded} crowded) | | | |")
            continue
        outside = sum(not row["holds"] for row in held)
        print(f"| {name} | {len(e)} ({crowded} crowded) | {statistics.median(e):+.0%} "
              f"| {min(e):+.0%} to {max(e):+.0%} | {outside} of {len(e)} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--repeats", type=int, default=12, help="runs (each: a pool, calibrate, check)")
    add("--passes", type=int, default=3, help="the calibration's passes per figure")
    add("--window", type=float, default=0.1, help="seconds each calibrated figure is timed over")
    add("--scale", type=float, default=None, help="also check with every compute rate this "
        "many times too fast")  # fmt: skip
    add("--out", default=str(ROOT / "benchmarks" / "results" / "step_check_spread.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more runs")
    if args.passes < 1:
        parser.error(f"--passes {args.passes}: give 1 or more")
    if not args.window > 0:
        parser.error(f"--window {args.window}: give seconds above 0 (0.1: the default)")
    if args.scale is not None and not args.scale > 0:
        parser.error(f"--scale {args.scale}: give a factor above 0 (2: twice too fast)")

    import torch

    import mgtutor
    from mgtutor.experiments import step_check
    from mgtutor.experiments.step_calibrate import scaled

    names = tuple(n for n in step_check.runnable() if not step_check.CONFIGS[n].emulated)
    bound = f"a factor {step_check.FACTOR:g}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        **machine(), "passes": args.passes, "window": args.window, "rounds": 2,
        "scale": args.scale, "bound": bound, "runs": [],
    }  # fmt: skip
    start = time.perf_counter()
    for run in range(args.repeats):
        with mgtutor.Pool(2, backend="gloo") as pool:
            hardware, extra, _ = step_check.calibrate_beside(
                pool, passes=args.passes, window=args.window)
            got = {"check": {m.name: _row(m) for m in step_check.check(
                pool, hardware, extra, rounds=2, configs=names)}}  # fmt: skip
            if args.scale is not None:
                wrong = scaled(hardware, args.scale)
                got["scaled"] = {m.name: _row(m) for m in step_check.check(
                    pool, wrong, extra, rounds=2, configs=names)}  # fmt: skip
        record["runs"].append(got)
        out.write_text(json.dumps(record, indent=1))  # every run kept, should a later one fail
        shown = ", ".join(
            f"{n} {row['error']:+.0%}" + ("" if row["asserted"] else " (crowded)")
            + (f" [x{args.scale:g}: {got['scaled'][n]['error']:+.0%}]" if "scaled" in got else "")
            for n, row in got["check"].items()
        )  # fmt: skip
        print(f"run {run + 1}/{args.repeats}: {shown} ({time.perf_counter() - start:.0f} s)",
              flush=True)  # fmt: skip

    print(f"\ntorch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; {args.repeats} runs, {args.passes} passes of {args.window:g} s, "
          f"held to {bound}")
    _table("The check as run:", record["runs"], "check", names)
    if args.scale is not None:
        _table(f"Every compute rate x{args.scale:g} (the counterfactual: 'outside' is caught):",
               record["runs"], "scaled", names)  # fmt: skip
    print(f"\nevery run: {out}")


if __name__ == "__main__":
    main()
