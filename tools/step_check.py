"""Check the step-time model against this machine's 2 CPU ranks, from a shell.

``python tools/step_check.py [rounds] [configuration ...]``: calibrate, then predict and measure
each configuration of ``mgtutor.experiments.step_check.CONFIGS`` (all by default, or those whose
names contain one of the given words), and print each prediction against the measured median on its
bound's scale (``Measured.shown``: emulated, the error; real, the ratio), with its terms deleted in
turn: what notebook 18's check cells and tests/experiments/test_step_check.py run. A configuration
is held to its bound only where other work left the ranks alone (``Measured.asserted``: at most
``step_check.CROWDED`` of a core beside real ranks, of the time waiting for a core for emulated
ones, counted by the ranks); the others print NOT CHECKED and why. Exits 1 where an asserted
configuration missed its bound or one of its deleted terms stayed within it, 2 where no
configuration of 2 ranks was asserted (nothing checked beyond the calibration).
"""

from __future__ import annotations

import time

import mgtutor
from mgtutor.experiments import step_check


def main() -> None:
    """Calibrate, predict, measure and print, as the module's docstring says."""
    import sys

    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 2
    names = tuple(n for n in step_check.runnable() if not args or any(a in n for a in args))
    with mgtutor.Pool(2, backend="gloo") as pool:
        start = time.perf_counter()
        hardware, extra, crowding = step_check.calibrate_beside(pool)
        print(f"calibration {time.perf_counter() - start:.1f} s (other work {crowding:.2f} cores)")
        measured = step_check.check(pool, hardware, extra, rounds=rounds, configs=names)
    failed = []
    for m in measured:
        deleted = "".join(f", without {k} {m.shown(m.deleted[k])}" for k in m.deleted)
        verdict = f"NOT CHECKED: {m.why_not}" if not m.asserted else (
            "asserted" if m.holds else "asserted, MISSED its bound")
        print(
            f"{m.name:42} predicted {m.predicted.total * 1e3:5.0f} ms, measured median "
            f"{m.median * 1e3:5.0f} ms ({min(m.seconds) * 1e3:.0f}-{max(m.seconds) * 1e3:.0f}), "
            f"{m.shown(m.predicted.total)}, held to {m.limit}{deleted}; "
            + (f"waited for a core {m.crowding:.0%}" if m.config.emulated
               else f"other work {m.crowding:.2f} cores") + f"; {verdict}"
        )
        if m.asserted and (not m.holds or any(m.holds_without(k) for k in m.deleted)):
            failed.append(m.name)
    held = [m for m in measured if m.asserted]
    print(f"{len(held)} of {len(measured)} configurations asserted; failed: {failed or 'none'}")
    if failed:
        raise SystemExit(1)
    if not [m for m in held if m.config.ranks > 1]:  # one rank alone checks the calibration
        print("NOTHING CHECKED: every configuration of 2 ranks was crowded")
        raise SystemExit(2)


if __name__ == "__main__":
    main()
