"""Check the step-time model against this machine's 2 CPU ranks, from a shell.

``python tools/step_check.py [rounds] [configuration ...]``: calibrate, then predict and measure
each configuration of ``mgtutor.measure.step_check.CONFIGS`` (all by default, or those whose
names contain one of the given words), and print each error with its terms deleted in turn: what
notebook 18's check cells and tests/measure/test_step_check.py run.
"""

from __future__ import annotations

import time

import mgtutor
from mgtutor.measure import step_check


def main() -> None:
    """Calibrate, predict, measure and print, as the module's docstring says."""
    import sys

    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 2
    names = tuple(n for n in step_check.runnable() if not args or any(a in n for a in args))
    asserted, why = step_check.tolerance()  # before the ranks add their own load
    emulated, why_emulated = step_check.tolerance("emulated")
    with mgtutor.Pool(2, backend="gloo") as pool:
        start = time.perf_counter()
        hardware, extra = step_check.calibrate(pool)
        print(f"calibration {time.perf_counter() - start:.1f} s")
        measured = step_check.check(pool, hardware, extra, rounds=rounds, configs=names)
    for m in measured:
        deleted = ", ".join(f"without {k} {m.error_without(k):+.0%}" for k in m.deleted)
        print(
            f"{m.name:42} predicted {m.predicted.total * 1e3:5.0f} ms, measured median "
            f"{m.median * 1e3:5.0f} ms ({min(m.seconds) * 1e3:.0f}-{max(m.seconds) * 1e3:.0f}), "
            f"error {m.error:+.0%} (bound {m.bound:.0%}) {deleted}"
        )
    print(f"two real ranks {'asserted' if asserted else 'not asserted'}: {why}")
    print(f"emulated ranks {'asserted' if emulated else 'not asserted'}: {why_emulated}")


if __name__ == "__main__":
    main()
