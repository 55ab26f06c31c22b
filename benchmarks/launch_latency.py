"""How long does ``mgtutor.launch`` take to start two workers, compared with plain PyTorch?

What it measures
    The wall time, seen from the launching process, of three things:

    * ``floor``: ``python -c "import torch"`` in a subprocess. Every spawned worker is a new
      Python process that must import torch, so this is the least any spawn-based launch can
      cost (with two workers on two or more cores, the two imports run side by side).
    * ``spawn``: plain ``torch.multiprocessing.spawn(..., nprocs=2, start_method="spawn")`` of an
      importable function (``benchmarks/_spawn_worker.py``) that sets RANK, WORLD_SIZE,
      MASTER_ADDR and MASTER_PORT itself, joins a gloo process group, passes one barrier and
      leaves the group.
    * ``mgtutor``: ``mgtutor.launch(work, world_size=2)``, where ``work`` (defined in this file,
      so it travels by value like a function from a notebook cell, and finds ``torch`` and
      ``mgtutor`` through the module's globals) calls ``mgtutor.setup()`` and one
      ``torch.distributed.barrier()``.

How
    Each case is run once untimed first (to warm the page cache and start multiprocessing's
    resource tracker). Then, in every round, the three cases run once each in a freshly shuffled
    order, so slow moments of a shared machine hit all three alike. Each time is
    ``time.perf_counter()`` around the whole call in this process. The script reports the
    median and the minimum of each case, and the ratio mgtutor / spawn two ways: the median of
    the per-round ratios (the headline: it compares runs made seconds apart) and the ratio of the
    medians.

    It also records the CPU seconds each call used, in this process and in the processes it
    started and waited for (``resource.getrusage``). Wall time is what the learner waits, and
    it is what the target is about; but when other work competes for the cores, the two workers
    no longer import torch side by side and the wall time jumps (on a busy 2-core machine it can
    double), while the CPU seconds barely move. If the wall times look bimodal, compare the CPU
    column.

    Note: spawn's children re-import the main script (here, this file) before they run the
    worker function; this file imports torch and mgtutor at the top, so the plain-spawn workers
    import the same modules as mgtutor's workers do. mgtutor's workers skip the re-import of
    ``__main__`` but import mgtutor and torch themselves.

Target (from the issue)
    The median ratio mgtutor / plain spawn is at most 1.10: spawn re-imports torch in every
    worker, that import is the floor, and mgtutor should add almost nothing to it.

Run it from the repository root::

    python benchmarks/launch_latency.py                 # 15 rounds
    python benchmarks/launch_latency.py --repeats 5     # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Let `python benchmarks/launch_latency.py` find mgtutor without installing it. Spawned workers
# get the same sys.path from multiprocessing, so they find it (and _spawn_worker) too.
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _spawn_worker import join_and_barrier  # noqa: E402

import mgtutor  # noqa: E402

WORLD_SIZE = 2
TARGET_RATIO = 1.10
CASES = ("floor", "spawn", "mgtutor")
LABELS = {
    "floor": '`python -c "import torch"` (floor)',
    "spawn": "plain `torch.multiprocessing.spawn`",
    "mgtutor": "`mgtutor.launch`",
}


def work() -> None:
    """One rank of the mgtutor case: join the process group and pass one barrier.

    Defined in ``__main__`` and using the module globals ``mgtutor`` and ``torch``, like a
    function written in a notebook cell; cloudpickle sends it to the workers by value.
    """
    mgtutor.setup()
    torch.distributed.barrier()


def free_port() -> int:
    """Ask the operating system for a port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_floor() -> None:
    """Start a new Python process that imports torch and exits."""
    subprocess.run([sys.executable, "-c", "import torch"], check=True)


def run_spawn() -> None:
    """Plain torch.multiprocessing.spawn of two ranks that pass one barrier."""
    port = free_port()  # a new port every trial, so no trial waits for the last one's socket
    mp.spawn(join_and_barrier, args=(WORLD_SIZE, port), nprocs=WORLD_SIZE, start_method="spawn")


def run_mgtutor() -> None:
    """mgtutor.launch of two ranks that call setup() and pass one barrier."""
    mgtutor.launch(work, world_size=WORLD_SIZE)


RUNNERS: dict[str, Callable[[], None]] = {
    "floor": run_floor,
    "spawn": run_spawn,
    "mgtutor": run_mgtutor,
}


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and by the child processes it has waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def measure(case: str) -> tuple[float, float]:
    """Run one case once; return its wall seconds and the CPU seconds it used."""
    cpu_before = cpu_seconds()
    started = time.perf_counter()
    RUNNERS[case]()
    wall = time.perf_counter() - started
    return wall, cpu_seconds() - cpu_before


def summarize(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, minimums and the mgtutor / spawn ratios of the timed rounds."""
    per_round = [m / s for m, s in zip(times["mgtutor"], times["spawn"], strict=True)]
    cases = {
        case: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "median_cpu_s": statistics.median(cpu[case]),
        }
        for case, values in times.items()
    }
    median_ratio = statistics.median(per_round)
    return {
        "cases": cases,
        "ratio_per_round": per_round,
        "ratio_median_of_rounds": median_ratio,
        "ratio_of_medians": cases["mgtutor"]["median_s"] / cases["spawn"]["median_s"],
        "ratio_of_mins": cases["mgtutor"]["min_s"] / cases["spawn"]["min_s"],
        "cpu_ratio_of_medians": cases["mgtutor"]["median_cpu_s"] / cases["spawn"]["median_cpu_s"],
        "target_ratio": TARGET_RATIO,
        "target_met": median_ratio <= TARGET_RATIO,
    }


def markdown_table(summary: dict[str, Any], rounds: int) -> str:
    """The results as a small Markdown table, ready to paste into the README."""
    cases = summary["cases"]
    spawn_median = cases["spawn"]["median_s"]
    lines = [
        f"| case ({rounds} rounds, world_size {WORLD_SIZE}) | median (s) | min (s) "
        "| median / plain spawn | median CPU (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in CASES:
        median, low = cases[case]["median_s"], cases[case]["min_s"]
        lines.append(
            f"| {LABELS[case]} | {median:.2f} | {low:.2f} | {median / spawn_median:.2f} "
            f"| {cases[case]['median_cpu_s']:.2f} |"
        )
    verdict = "met" if summary["target_met"] else "NOT met"
    lines += [
        "",
        f"mgtutor / spawn: median of per-round ratios **{summary['ratio_median_of_rounds']:.3f}**"
        f", ratio of medians {summary['ratio_of_medians']:.3f}"
        f" (target <= {TARGET_RATIO:.2f}: {verdict}); CPU seconds, ratio of medians"
        f" {summary['cpu_ratio_of_medians']:.3f}.",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed rounds; each runs every case once"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "launch_latency.json",
        help="where to write the raw timings and the summary (JSON)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the order shuffles")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    rng = random.Random(args.seed)

    print("Warm-up: one untimed run of each case ...", flush=True)
    warmup = {case: measure(case)[0] for case in CASES}

    times: dict[str, list[float]] = {case: [] for case in CASES}
    cpu: dict[str, list[float]] = {case: [] for case in CASES}
    orders: list[list[str]] = []
    for round_index in range(args.repeats):
        order = rng.sample(CASES, k=len(CASES))
        orders.append(order)
        for case in order:
            wall, used = measure(case)
            times[case].append(wall)
            cpu[case].append(used)
        done = ", ".join(f"{case} {times[case][-1]:.2f}s" for case in CASES)
        print(f"round {round_index + 1}/{args.repeats}: {done}", flush=True)

    summary = summarize(times, cpu)
    result = {
        "benchmark": "launch_latency",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "world_size": WORLD_SIZE,
        "repeats": args.repeats,
        "seed": args.seed,
        "warmup_s": warmup,
        "round_orders": orders,
        "times_s": times,
        "cpu_s": cpu,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(markdown_table(summary, args.repeats))
    print(f"\nRaw timings written to {args.out}")


if __name__ == "__main__":
    main()
