"""How long does ``mgtutor.launch`` take to start two ranks, against plain PyTorch and a peer?

What it measures
    The wall time, seen from the launching process, of one launch of 2 ranks that join a gloo
    process group and pass one barrier, started six ways:

    * ``floor``: ``python -c "import torch"`` in a subprocess. A spawned rank is a new Python
      process that must import torch, so no spawn-based launch can cost less.
    * ``spawn``: plain ``torch.multiprocessing.start_processes(..., start_method="spawn")`` of an
      importable function (``benchmarks/_spawn_worker.py``) that sets RANK, WORLD_SIZE,
      MASTER_ADDR and MASTER_PORT itself, joins the group, passes one barrier, leaves.
    * ``forkserver``: the same with ``start_method="forkserver"``, after
      ``set_forkserver_preload(["torch", "torch.distributed"])``: the server imports torch once
      and forks each rank from that state.
    * ``mgtutor``: ``mgtutor.launch(work, world_size=2)`` with its default start method (the
      forkserver), where ``work`` is defined in this file, so it travels by value like a function
      from a notebook cell, and calls ``mgtutor.setup()`` and one barrier.
    * ``mgtutor-spawn``: the same with ``start_method="spawn"``.
    * ``accelerate``: Hugging Face Accelerate's ``notebook_launcher(fn, num_processes=2)``, which
      forks the ranks (so it refuses to run once CUDA was used in the process). Measured only if
      ``accelerate`` is installed (``pip install accelerate``; it is not a dependency of the
      workbook); skipped and said so otherwise.

How
    Each case runs once untimed first: that first launch is the *cold* start a notebook pays
    once (it starts the forkserver, warms the page cache), reported separately. Then, in every
    round, all cases run once each in a freshly shuffled order, so slow moments of a shared
    machine hit them alike. Each time is ``time.perf_counter()`` around the whole call. The
    script reports the median, minimum and maximum of each case and, per case, the median of the
    per-round ratios to plain spawn (runs made seconds apart).

    It also records the CPU seconds each call used, in this process and in the children it waited
    for (``resource.getrusage``; forkserver children are the server's, so their CPU is not seen
    here and that column is blank for them).

Target (from the launcher issues)
    After the first launch in a process, ``mgtutor.launch`` on 2 ranks takes at most 0.15x plain
    spawn's time in the same run (median of per-round ratios); with ``start_method="spawn"`` it
    adds at most 10 % to plain spawn.

Run it from the repository root::

    python benchmarks/launch_latency.py                 # 15 rounds
    python benchmarks/launch_latency.py --repeats 5     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
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
from _machine import machine  # noqa: E402
from _spawn_worker import join_and_barrier  # noqa: E402

import mgtutor  # noqa: E402

WORLD_SIZE = 2
# Per case: the most its median per-round ratio to plain spawn may be.
TARGETS = {"mgtutor": 0.15, "mgtutor-spawn": 1.10}
ALL_CASES = ("floor", "spawn", "forkserver", "mgtutor", "mgtutor-spawn", "accelerate")
LABELS = {
    "floor": '`python -c "import torch"` (floor of a spawned rank)',
    "spawn": "plain `start_processes`, spawn",
    "forkserver": "plain `start_processes`, forkserver + torch preloaded",
    "mgtutor": "`mgtutor.launch` (forkserver, the default)",
    "mgtutor-spawn": '`mgtutor.launch(start_method="spawn")`',
    "accelerate": "Accelerate `notebook_launcher` (fork)",
}
# The forkserver's preload, as mgtutor's: what the server imports once before forking ranks.
mp.set_forkserver_preload(["torch", "torch.distributed"])


def accelerate_available() -> bool:
    """Whether Hugging Face Accelerate is installed (only this benchmark uses it)."""
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


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


def run_plain(start_method: str) -> None:
    """Plain torch.multiprocessing.start_processes of two ranks that pass one barrier."""
    port = free_port()  # a new port every trial, so no trial waits for the last one's socket
    mp.start_processes(
        join_and_barrier, args=(WORLD_SIZE, port), nprocs=WORLD_SIZE, start_method=start_method
    )


def run_accelerate() -> None:
    """Accelerate's notebook_launcher of two CPU ranks that join gloo and pass one barrier."""
    from accelerate import notebook_launcher

    notebook_launcher(accelerate_work, num_processes=WORLD_SIZE, use_port=str(free_port()))


def accelerate_work() -> None:
    """One rank under notebook_launcher: it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


RUNNERS: dict[str, Callable[[], None]] = {
    "floor": run_floor,
    "spawn": lambda: run_plain("spawn"),
    "forkserver": lambda: run_plain("forkserver"),
    "mgtutor": lambda: mgtutor.launch(work, world_size=WORLD_SIZE),
    "mgtutor-spawn": lambda: mgtutor.launch(work, world_size=WORLD_SIZE, start_method="spawn"),
    "accelerate": run_accelerate,
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


def summarize(
    cases: tuple[str, ...], times: dict[str, list[float]], cpu: dict[str, list[float]]
) -> dict[str, Any]:
    """Medians, spreads and each case's per-round ratio to plain spawn."""
    summary: dict[str, Any] = {"cases": {}, "targets": TARGETS}
    for case in cases:
        ratios = [t / s for t, s in zip(times[case], times["spawn"], strict=True)]
        summary["cases"][case] = {
            "median_s": statistics.median(times[case]),
            "min_s": min(times[case]),
            "max_s": max(times[case]),
            "median_cpu_s": statistics.median(cpu[case]),
            "ratio_per_round": ratios,
            "ratio_median_of_rounds": statistics.median(ratios),
        }
    summary["target_met"] = {
        case: summary["cases"][case]["ratio_median_of_rounds"] <= limit
        for case, limit in TARGETS.items()
        if case in summary["cases"]
    }
    return summary


def markdown_table(
    summary: dict[str, Any], rounds: int, warmup: dict[str, float], skipped: list[str]
) -> str:
    """The results as a Markdown table, ready to paste into the README."""
    cases = summary["cases"]
    lines = [
        f"| case (world size {WORLD_SIZE}, {rounds} rounds) | first launch (s) | median (s) "
        "| min - max (s) | median / plain spawn, per round | median CPU (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case, row in cases.items():
        # A forkserver's ranks are the server's children, invisible to this process's rusage.
        forked_elsewhere = case in ("forkserver", "mgtutor")
        cpu_text = "-" if forked_elsewhere else f"{row['median_cpu_s']:.2f}"
        first = f"{warmup[case]:.2f}" + (" (server running)" if case == "forkserver" else "")
        lines.append(
            f"| {LABELS[case]} | {first} | {row['median_s']:.3f} "
            f"| {row['min_s']:.3f} - {row['max_s']:.3f} | {row['ratio_median_of_rounds']:.3f} "
            f"| {cpu_text} |"
        )
    lines.append("")
    for case, met in summary["target_met"].items():
        verdict = "met" if met else "NOT met"
        lines.append(
            f"- {LABELS[case]}: {cases[case]['ratio_median_of_rounds']:.3f}x plain spawn "
            f"(target <= {TARGETS[case]:.2f}: {verdict})"
        )
    for case in skipped:
        lines.append(f"- {LABELS[case]}: skipped, `accelerate` is not installed")
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
    skipped = [] if accelerate_available() else ["accelerate"]
    cases = tuple(case for case in ALL_CASES if case not in skipped)
    if skipped:
        print("accelerate is not installed: its case is skipped (pip install accelerate)")

    print("First launch of each case (untimed in the rounds) ...", flush=True)
    # mgtutor first: its first launch starts the forkserver, which the plain forkserver case then
    # shares (one server per process), so only mgtutor's first launch includes the server start.
    warmup = {case: measure(case)[0] for case in sorted(cases, key=lambda c: c != "mgtutor")}
    print(", ".join(f"{case} {seconds:.2f}s" for case, seconds in warmup.items()), flush=True)

    times: dict[str, list[float]] = {case: [] for case in cases}
    cpu: dict[str, list[float]] = {case: [] for case in cases}
    orders: list[list[str]] = []
    for round_index in range(args.repeats):
        order = rng.sample(cases, k=len(cases))
        orders.append(order)
        for case in order:
            wall, used = measure(case)
            times[case].append(wall)
            cpu[case].append(used)
        done = ", ".join(f"{case} {times[case][-1]:.2f}s" for case in cases)
        print(f"round {round_index + 1}/{args.repeats}: {done}", flush=True)

    summary = summarize(cases, times, cpu)
    result = {
        "benchmark": "launch_latency",
        **machine(),
        "load_average": os.getloadavg(),
        "world_size": WORLD_SIZE,
        "repeats": args.repeats,
        "seed": args.seed,
        "skipped": skipped,
        "first_launch_s": warmup,
        "round_orders": orders,
        "times_s": times,
        "cpu_s": cpu,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print()
    print(markdown_table(summary, args.repeats, warmup, skipped))
    print(f"\nLoad average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print(f"Raw timings written to {args.out}")


if __name__ == "__main__":
    main()
