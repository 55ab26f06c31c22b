"""How far do the step-time check's real configurations land from their predictions, run to run?

What it measures
    ``mgtutor.measure.step_check`` holds each real configuration (one process, DDP, TP and, from
    torch 2.5, a 2-stage ``Schedule1F1B``: GPT layers on 2 gloo CPU ranks) to
    ``step_check.BOUND["real"]``. A run is a fresh calibration (``calibrate_beside``) and a check
    of those configurations (``rounds=2``, as tests/measure/test_step_check.py and notebook 18 run
    it). Each run's error ((predicted - measured median) / measured median) is a new draw of the
    calibration's and the steps' noise; this script repeats runs and prints, per configuration,
    the median, the range and how many runs fell outside the bound. It is the evidence for the
    bound: a bound inside this range would fail on a quiet machine; one far outside it checks
    less than it could.

Run it alone on an otherwise idle machine: ``python benchmarks/step_check_spread.py``
(12 runs: about 5 minutes on 2 cores). Runs where other work crowded the ranks or the
calibration (``Measured.asserted`` false) are counted apart: the check does not assert them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=12, help="runs (each: calibrate, check)")
    parser.add_argument("--out", default="benchmarks/results/step_check_spread.json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more runs")

    import torch

    import mgtutor
    from mgtutor.measure import step_check

    names = tuple(n for n in step_check.runnable() if not step_check.CONFIGS[n].emulated)
    errors: dict[str, list[float]] = {n: [] for n in names}
    crowded: dict[str, int] = {n: 0 for n in names}
    start = time.perf_counter()
    with mgtutor.Pool(2, backend="gloo") as pool:
        for run in range(args.repeats):
            hardware, extra, _ = step_check.calibrate_beside(pool)
            shown = []
            for m in step_check.check(pool, hardware, extra, rounds=2, configs=names):
                if m.asserted:
                    errors[m.name].append(m.error)
                else:
                    crowded[m.name] += 1
                shown.append(f"{m.name} {m.error:+.0%}" + ("" if m.asserted else " (crowded)"))
            print(f"run {run + 1}/{args.repeats}: " + ", ".join(shown)
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip

    bound = step_check.BOUND["real"]
    print(f"\ntorch {torch.__version__}, {args.repeats} runs, bound {bound:.0%}\n")
    print("| configuration | runs asserted | median error | range | outside the bound |")
    print("|---|---|---|---|---|")
    for name, e in errors.items():
        if not e:
            print(f"| {name} | 0 ({crowded[name]} crowded) | | | |")
            continue
        outside = sum(abs(x) > bound for x in e)
        print(f"| {name} | {len(e)} ({crowded[name]} crowded) | {statistics.median(e):+.0%} "
              f"| {min(e):+.0%} to {max(e):+.0%} | {outside} |")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "bound": bound, "errors": errors,
                               "crowded": crowded}, indent=1))  # fmt: skip
    print(f"\nraw errors: {out}")


if __name__ == "__main__":
    main()
