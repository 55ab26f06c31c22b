"""The workbook's training script under torchrun on CPU: one node, two nodes, a restart, @record."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "notebooks" / "scripts" / "train_ddp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# One thread per worker in every run, as torchrun gives the single-node run's two workers
# (OMP_NUM_THREADS=1 whenever it starts more than one per node): same sums, same order.
# No MGTUTOR_BACKEND either: each worker's setup() chooses, as in the notebook.
ONE_THREAD = {
    **{name: value for name, value in os.environ.items() if name != "MGTUTOR_BACKEND"},
    "OMP_NUM_THREADS": "1",
}

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def family(pid: int) -> set[psutil.Process]:
    """A process and all it started, found by parentage while it runs.

    torchrun starts each worker in a session of its own (start_new_session=True in torch's
    SubprocessHandler), so killing torchrun's process group leaves the workers running.
    """
    try:
        root = psutil.Process(pid)
        return {root, *root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def running(procs) -> list[psutil.Process]:
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def stop_all(procs, timeout: float = 10) -> None:
    """SIGKILL every process still running; fail if one survives."""
    for p in running(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    deadline = time.monotonic() + timeout
    while running(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(procs), f"still running after SIGKILL: {[p.pid for p in running(procs)]}"


def run_all(
    commands: list[list[str]], env: dict, timeout: float = 200
) -> list[subprocess.CompletedProcess]:
    """Run the commands at once; at the end, or past the timeout, stop all they started."""
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for command in commands
    ]
    started: set[psutil.Process] = set()
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(len(procs)) as readers:
        outputs = [readers.submit(proc.communicate) for proc in procs]
        while not all(o.done() for o in outputs) and time.monotonic() < deadline:
            for proc in procs:
                started |= family(proc.pid)
            time.sleep(0.1)
        timed_out = not all(o.done() for o in outputs)
        stop_all(started)  # the workers too: nothing is left behind, even past the timeout
    if timed_out:
        raise TimeoutError(f"stopped after {timeout} s with all it started: {commands}")
    return [
        subprocess.CompletedProcess(p.args, p.returncode, *o.result())
        for p, o in zip(procs, outputs)
    ]


def results(prefix: Path, world_size: int) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world_size)]


# What each worker reports of torchrun's variables, in this order.
CONTRACT = (
    "rank",
    "local_rank",
    "world_size",
    "group_rank",
    "local_world_size",
    "group_world_size",
)


def contract(row: dict) -> tuple:
    return tuple(row[key] for key in CONTRACT)


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("single")
    [done] = run_all(
        [
            [
                *TORCHRUN,
                "--standalone",
                "--nproc-per-node=2",
                str(SCRIPT),
                "--epochs",
                "2",
                "--backend",  # named: the runs compared bit for bit with it all do gloo's sums
                "gloo",
                "--result",
                str(work / "run"),
            ]
        ],
        env=ONE_THREAD,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 1: mean loss" in done.stdout
    return results(work / "run", 2)


def test_standalone_torchrun_gives_each_worker_the_contract(single_node) -> None:
    assert [contract(r) for r in single_node] == [(0, 0, 2, 0, 2, 1), (1, 1, 2, 0, 2, 1)]
    assert [(r["backend"], r["device"]) for r in single_node] == [("gloo", "cpu")] * 2
    assert single_node[0]["weights"] == single_node[1]["weights"]
    assert single_node[0]["losses"] == single_node[1]["losses"]
    assert len(single_node[0]["losses"]) == 2 * 1024 // (2 * 32), "one mean loss per step"


@pytest.mark.repeats_notebook("09_torchrun_multinode.ipynb")
def test_two_nodes_on_loopback_match_the_single_node_run(tmp_path, single_node) -> None:
    port = free_port()
    commands = [
        [
            *TORCHRUN,
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(SCRIPT),
            "--epochs",
            "2",
            "--result",
            str(tmp_path / "run"),
        ]
        for node in (0, 1)
    ]
    nodes = run_all(commands, env=ONE_THREAD)
    assert all(node.returncode == 0 for node in nodes), [node.stderr[-2000:] for node in nodes]
    two = results(tmp_path / "run", 2)
    # Static rendezvous: --node-rank is the node's GROUP_RANK; WORLD_SIZE counts processes.
    assert [contract(r) for r in two] == [(0, 0, 2, 0, 1, 2), (1, 0, 2, 1, 1, 2)]
    assert all(r["master_addr"] == "127.0.0.1" for r in two)
    # No --backend: on one machine both nodes' workers have LOCAL_RANK 0, so setup() picks
    # gloo, even with GPUs (NCCL would refuse two ranks on cuda:0). Each worker says so.
    assert [(r["backend"], r["device"]) for r in two] == [("gloo", "cpu")] * 2
    said = [line for node in nodes for line in node.stdout.splitlines() if line.startswith("RANK=")]
    assert len(said) == 2 and all(line.endswith("| gloo on cpu") for line in said), said
    # The topology does not change the arithmetic: equal, not merely close.
    assert two[0]["weights"] == two[1]["weights"] == single_node[0]["weights"]
    assert two[0]["losses"] == single_node[0]["losses"]


@pytest.mark.repeats_notebook("09_torchrun_multinode.ipynb")
def test_restart_resumes_from_the_snapshot_on_the_same_loss_curve(tmp_path, single_node) -> None:
    import torch

    [done] = run_all(
        [
            [
                *TORCHRUN,
                "--standalone",
                "--nproc-per-node=2",
                "--max-restarts=1",
                str(SCRIPT),
                "--epochs",
                "2",
                "--snapshot",
                str(tmp_path / "snap.pt"),
                "--crash-once",
                str(tmp_path / "crashed"),
                "--backend",
                "gloo",
                "--result",
                str(tmp_path / "run"),
            ]
        ],
        env={**ONE_THREAD, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "crashed").exists(), "rank 1 was killed once"
    assert "resuming from the snapshot of epoch 0" in done.stdout
    resumed = results(tmp_path / "run", 2)
    # Every step's loss, the restored first epoch's and the repeated second epoch's, bit for bit.
    assert resumed[0]["losses"] == resumed[1]["losses"] == single_node[0]["losses"]
    assert resumed[0]["weights"] == resumed[1]["weights"] == single_node[0]["weights"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("run")) == [
        "crashed",
        "snap.pt",
    ], "no partial snapshot left behind"
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    assert sorted(snap) == ["losses", "model", "optimizer", "rng", "sampler", "scaler", "scheduler"]
    assert snap["sampler"] == {"seed": 0, "epoch": 1}
    assert snap["scaler"] == {}, "GradScaler is disabled on CPU; its empty state is saved anyway"
    assert snap["scheduler"]["last_epoch"] == len(snap["losses"]) == len(single_node[0]["losses"])
    # One set of generator states per rank, and the ranks' differ (seeded with 1 + rank).
    assert len(snap["rng"]) == 2
    assert not torch.equal(snap["rng"][0]["torch"], snap["rng"][1]["torch"])


@pytest.mark.repeats_notebook("09_torchrun_multinode.ipynb")
def test_record_writes_the_exception_to_torchelastic_error_file(tmp_path) -> None:
    # What torchrun gives a single worker, set by hand: one process fewer than torchrun would start.
    worker_env = {
        **ONE_THREAD,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--fail-on-rank", "0"],
        capture_output=True,
        text=True,
        timeout=200,
        env=worker_env,
    )
    assert done.returncode == 1
    message = "ValueError: rank 0 cannot read its shard (raised on purpose by --fail-on-rank)"
    assert message in done.stderr
    error = json.loads((tmp_path / "error.json").read_text())["message"]
    assert error["message"] == message
    assert "raise ValueError" in error["extraInfo"]["py_callstack"]


def test_killing_torchruns_process_group_leaves_workers_that_stop_all_ends() -> None:
    # Why run_all collects processes by parentage: torchrun's workers have sessions of their own.
    agent = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--no-python", "sleep", "300"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = [p for p in family(agent.pid) if p.pid != agent.pid]
            time.sleep(0.1)
        assert len(workers) == 2, "torchrun did not start its two workers within 60 s"
        assert all(os.getsid(p.pid) == p.pid != agent.pid for p in workers)
        os.killpg(agent.pid, signal.SIGKILL)  # torchrun's whole process group
        agent.wait()
        time.sleep(1)
        assert len(running(workers)) == 2, "the workers died with torchrun's process group"
    finally:
        stop_all([*workers, *family(agent.pid)])
        agent.wait()
    assert not running(workers)
