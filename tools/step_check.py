"""Check the step-time model against this machine's 2 CPU ranks, from a shell.

``python tools/step_check.py [rounds] [matmul] [back-to-back] [calibrated-latency]``: calibrate,
predict, measure, print (what notebook 18's check cells and tests/plan/test_step_time.py run).
``matmul``: at a bare product's FLOP/s; ``back-to-back``: the collectives timed back to back
(each predicts too fast); ``calibrated-latency``: every step at the calibration's per-call
latencies, not re-timed before it. Exits 1 where a configuration other work left alone
missed the bound, 2 where other work crowded the calibration or every configuration of 2 ranks
(nothing checked beyond the calibration).
"""

from __future__ import annotations

import time

import mgtutor
from mgtutor.measure.step_check import CROWDED, TOLERANCE, calibrate_beside, check


def main() -> None:
    """Calibrate, predict, measure and print, as the module's docstring says."""
    import sys

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rate = "matmul" if "matmul" in sys.argv[2:] else "step"
    apart = "back-to-back" not in sys.argv[2:]
    retime = "calibrated-latency" not in sys.argv[2:]
    with mgtutor.Pool(2, backend="gloo") as pool:
        start = time.perf_counter()
        hardware, crowding = calibrate_beside(pool, rate=rate, after_compute=apart)
        print(
            f"calibration {time.perf_counter() - start:.1f} s (other work {crowding:.2f} cores), "
            f"FLOP/s of a {rate}, "
            + ("collectives after compute" if apart else "collectives back to back")
        )
        measured = check(pool, hardware, rounds=rounds, rate=rate, retime=retime)
    link, f = hardware.intra, hardware.flops
    print(
        f"a layer step {f['fp32'] / 1e9:.0f} GFLOP/s a rank with both busy, "
        f"{f['fp32_alone'] / 1e9:.0f} alone (a bare product {f['matmul'] / 1e9:.0f} and "
        f"{f['matmul_alone'] / 1e9:.0f}); all-reduce {link.latency * 1e6:.0f} us + bytes / "
        f"{link.bandwidth / 1e9:.2f} GB/s; send {link.p2p_latency * 1e6:.0f} us + bytes / "
        f"{link.p2p_bandwidth / 1e9:.2f} GB/s; copy {hardware.copy / 1e9:.1f} GB/s"
    )
    for m in measured:
        print(
            f"{m.name:34} predicted {m.predicted.total * 1e3:5.0f} ms, measured median "
            f"{m.median * 1e3:5.0f} ms ({min(m.seconds) * 1e3:.0f}-{max(m.seconds) * 1e3:.0f}), "
            f"error {m.error:+.0%}, other work {m.crowding:.2f} cores; "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in m.predicted.parts.items() if v)
        )
    quiet = [m for m in measured if m.asserted] if crowding <= CROWDED else []
    if not [m for m in quiet if m.name != "one process"]:  # one alone checks the calibration
        print(f"NOT CHECKED: other work used more than {CROWDED} cores beside the ranks")
        raise SystemExit(2)
    within = all(abs(m.error) <= TOLERANCE for m in quiet)
    print(
        f"bound {TOLERANCE:.0%} on the {len(quiet)} of {len(measured)} configurations other work "
        "left alone: " + ("all within" if within else "NOT all within")
    )
    if not within:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
