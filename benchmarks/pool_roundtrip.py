"""How long does one call to ranks that are already running take, against the peers?

What it measures
    The round trip of a no-op on 2 ranks that are already running, seen from the caller, for:

    * ``raw pipe``: a ``multiprocessing`` pipe to each of 2 running processes that echo what
      they receive; one small message sent to both, both answers read. Nothing is pickled
      but the message, nothing relayed or measured: the floor a pool call is compared with.
    * ``pool.run``: ``mgtutor.Pool(world_size=2).run(noop)``. The call returns a full
      :class:`mgtutor.Run`: each rank's result, relayed output, wall time, timing records and
      memory figures.
    * ``pool.run, fn naming torch``: the same with a no-op that reads the global ``torch``.
      cloudpickle pickles such a function by value with a scan of every loaded module (about
      0.8 ms with torch loaded); the pool reuses the pickled bytes while nothing in them can
      have changed (``mgtutor/launcher/_payload.py``).
    * ``%%ddp (kernel)``: a notebook cell ``%%ddp`` / ``pass`` executed in a real
      IPython kernel (jupyter_client), timed from sending the cell to its ``execute_reply``.
      ``kernel: pass`` is a plain ``pass`` cell in the same kernel: the kernel's own share.
    * ``launch``: ``mgtutor.launch(noop, world_size=2)``, which starts two new rank processes
      (forked from mgtutor's server), runs the call and ends them: the cold path, for scale.
    * ``ipyparallel``: ``Client()[:].apply_sync(noop)`` on a cluster of 2 engines
      (``ipyparallel.Cluster(n=2)``), the bar the pool issue sets.
    * ``nbdistributed``: its ``CommunicationManager.send_to_all("execute", "None")`` on 2 workers
      started by its ``ProcessManager``: the call its ``%%distributed`` magic makes (the magic
      itself then polls for output every 100 ms, which this leaves out in its favour).

    The peers are measured only where installed (``pip install ipyparallel nbdistributed``; they
    are not dependencies of the workbook), and are skipped, saying so, elsewhere. Each one's start
    (cluster or workers up and answering) is timed once too.

How
    Everything is started first and kept running; then, in every round, each case runs once in
    a freshly shuffled order, so slow moments of a shared machine hit them alike (``launch``
    runs in every fifth round only). Each time is ``time.perf_counter()`` around one call. The
    script prints the median, quartiles, minimum and maximum of each case, and the median
    per-round ratios of ``pool.run`` to the raw pipe and to ipyparallel.

Targets (from the pool issues)
    ``pool.run`` within 3x the raw pipe's round trip (issue 24), and at or under ipyparallel's
    median in the same run, the fastest of the peers (issue 14).

Run it from the repository root, on an otherwise idle machine::

    python benchmarks/pool_roundtrip.py               # 200 rounds, 1 to 3 minutes
    python benchmarks/pool_roundtrip.py --no-kernel   # without the %%ddp kernel rows
    python benchmarks/pool_roundtrip.py --no-kernel --no-launch   # the raw pipe and pool.run
    python benchmarks/pool_roundtrip.py --repeats 50
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from _machine import machine  # noqa: E402

import mgtutor  # noqa: E402

WORLD_SIZE = 2


def noop() -> None:
    return None


def names_torch() -> str:
    """A no-op that reads the global ``torch``, as nearly every rank function does."""
    return torch.__version__


def _echo(conn: Any) -> None:
    """The raw pipe's other end: send back what comes, until None."""
    while (message := conn.recv()) is not None:
        conn.send(message)


class RawPipes:
    """``n`` running processes, each at the end of a plain ``multiprocessing`` pipe."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self.ends = []
        self.processes = []
        for _ in range(n):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_echo, args=(theirs,), daemon=True)
            process.start()
            theirs.close()
            self.ends.append(ours)
            self.processes.append(process)

    def run(self) -> None:
        for end in self.ends:
            end.send(1)
        for end in self.ends:
            end.recv()

    def close(self) -> None:
        for end in self.ends:
            end.send(None)
        for process in self.processes:
            process.join(5)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


class KernelCell:
    """A real IPython kernel, cells sent through jupyter_client as a notebook would."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=str(HERE.parent))

    def run(self, code: str) -> None:
        msg_id = self.client.execute(code, store_history=False)
        while True:
            reply = self.client.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the kernel failed to run {code!r}: {reply['content']}")
        # Drain the outputs so they do not pile up (not timed: the reply came first).
        while self.client.iopub_channel.msg_ready():
            self.client.get_iopub_msg(timeout=1)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def start_cases(skip: set[str]) -> tuple[dict[str, Callable[[], Any]], dict[str, Any], list]:
    cases: dict[str, Callable[[], Any]] = {}
    starts: dict[str, Any] = {}
    closers: list[Callable[[], Any]] = []

    raw = RawPipes(WORLD_SIZE)  # first, forked before this process starts any thread
    closers.append(raw.close)
    cases["raw pipe"] = raw.run

    t0 = time.perf_counter()
    mgtutor.launch(noop, world_size=WORLD_SIZE)  # starts mgtutor's forkserver: not a pool cost
    starts["first launch (forkserver start)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool = mgtutor.Pool(world_size=WORLD_SIZE, backend="gloo")
    starts["pool.run"] = time.perf_counter() - t0
    closers.append(pool.close)
    cases["pool.run"] = lambda: pool.run(noop)
    cases["pool.run, fn naming torch"] = lambda: pool.run(names_torch)
    if "launch" not in skip:
        cases["launch"] = lambda: mgtutor.launch(noop, world_size=WORLD_SIZE)

    if "kernel" not in skip:
        t0 = time.perf_counter()
        kernel = KernelCell()
        kernel.run("%load_ext mgtutor\n%ddp_start -n 2 --backend gloo")
        starts["%%ddp (kernel)"] = time.perf_counter() - t0
        closers.append(kernel.close)
        cases["%%ddp (kernel)"] = lambda: kernel.run("%%ddp\npass")
        cases["kernel: pass"] = lambda: kernel.run("pass")

    try:
        import ipyparallel as ipp
    except ImportError:
        starts["ipyparallel"] = "not installed: skipped (pip install ipyparallel)"
    else:
        t0 = time.perf_counter()
        cluster = ipp.Cluster(n=WORLD_SIZE, log_level=40)
        client = cluster.start_and_connect_sync()
        view = client[:]
        view.apply_sync(noop)
        starts["ipyparallel"] = time.perf_counter() - t0
        closers.append(lambda: (client.close(), cluster.stop_cluster_sync()))
        cases["ipyparallel"] = lambda: view.apply_sync(noop)

    try:
        from nbdistributed.communication import CommunicationManager
        from nbdistributed.process_manager import ProcessManager
    except ImportError:
        starts["nbdistributed"] = "not installed: skipped (pip install nbdistributed)"
    else:
        t0 = time.perf_counter()
        manager = ProcessManager()
        try:
            port = manager.start_workers(WORLD_SIZE, "localhost", None)
            comm = CommunicationManager(WORLD_SIZE, port)
            comm.send_to_all("execute", "None", timeout=30)
        except Exception as exc:  # it did not come up here: say so, measure the others
            starts["nbdistributed"] = f"did not answer ({type(exc).__name__}: {exc}): skipped"
            manager.shutdown()
        else:
            starts["nbdistributed"] = time.perf_counter() - t0
            closers.append(lambda: (comm.shutdown(), manager.shutdown()))
            cases["nbdistributed"] = lambda: comm.send_to_all("execute", "None")
    return cases, starts, closers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="rounds (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kernel", action="store_true", help="leave out the %%ddp kernel")
    parser.add_argument(
        "--no-launch", action="store_true", help="leave out mgtutor.launch (its processes' ends)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pool_roundtrip.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    left_out = {"kernel": args.no_kernel, "launch": args.no_launch}
    cases, starts, closers = start_cases({name for name, skip in left_out.items() if skip})
    times: dict[str, list[float]] = {name: [] for name in cases}
    ratios: list[float] = []
    raw_ratios: list[float] = []
    load_before = os.getloadavg()[0]
    try:
        for call in cases.values():  # one untimed call each
            call()
        for round_index in range(args.repeats):
            order = [n for n in cases if n != "launch" or round_index % 5 == 0]
            rng.shuffle(order)
            this_round = {}
            for name in order:
                this_round[name] = _timed(cases[name])
                times[name].append(this_round[name])
            if "ipyparallel" in this_round:
                ratios.append(this_round["pool.run"] / this_round["ipyparallel"])
            raw_ratios.append(this_round["pool.run"] / this_round["raw pipe"])
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # report, keep closing the others
                print(f"closing a case failed: {exc}", file=sys.stderr)

    print(
        f"\ntorch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores, load average {load_before:.2f} before the rounds and "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print("\n| call (2 ranks, already running) | median | quartiles | min | max | calls |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        low_q, _, high_q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        print(
            f"| {name} | {_ms(statistics.median(values))} | {_ms(low_q)} - {_ms(high_q)} | "
            f"{_ms(min(values))} | {_ms(max(values))} | {len(values)} |"
        )
    print("\n| start (once) | seconds |")
    print("|---|---|")
    for name, value in starts.items():
        shown = f"{value:.2f} s" if isinstance(value, float) else value
        print(f"| {name} | {shown} |")
    raw_ratio = statistics.median(raw_ratios)
    of_medians = statistics.median(times["pool.run"]) / statistics.median(times["raw pipe"])
    low_q, _, high_q = statistics.quantiles(raw_ratios, n=4)
    print(
        f"\npool.run / raw pipe, median of per-round ratios: {raw_ratio:.2f} (quartiles "
        f"{low_q:.2f} - {high_q:.2f}; ratio of medians {of_medians:.2f}; "
        f"{'meets' if raw_ratio <= 3 else 'misses'} the target of <= 3)"
    )
    if ratios:
        ratio = statistics.median(ratios)
        verdict = "meets" if ratio <= 1 else "misses"
        print(
            f"\npool.run / ipyparallel, median of per-round ratios: {ratio:.2f} "
            f"({verdict} the target of <= 1.00)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "pool_roundtrip",
                **machine(),
                "times": times,
                "starts": {k: str(v) for k, v in starts.items()},
                "ratios": ratios,
                "raw_ratios": raw_ratios,
                "load_before": load_before,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
