"""The workbook's training script under torchrun on CPU: one node, two nodes, a restart."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "notebooks" / "scripts" / "train_ddp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def results(prefix: Path, world_size: int) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("single")
    done = subprocess.run(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPT),
            "--epochs",
            "2",
            "--result",
            str(work / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 1: mean loss" in done.stdout
    return results(work / "run", 2)


def test_standalone_torchrun_gives_each_worker_the_contract(single_node) -> None:
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in single_node] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert single_node[0]["weights"] == single_node[1]["weights"]


def test_two_nodes_on_loopback_match_the_single_node_run(tmp_path, single_node) -> None:
    command = [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=test",
        str(SCRIPT),
        "--epochs",
        "2",
        "--result",
        str(tmp_path / "run"),
    ]
    # One thread per worker, as torchrun gives the single-node run's two workers
    # (OMP_NUM_THREADS=1 whenever it starts more than one per node): same sums, same order.
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=one_thread
        )
        for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=200) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    two = results(tmp_path / "run", 2)
    assert sorted((r["rank"], r["local_rank"]) for r in two) == [(0, 0), (1, 0)]
    assert sorted(r["group_rank"] for r in two) == [0, 1]
    # The topology does not change the arithmetic: equal, not merely close.
    assert two[0]["weights"] == two[1]["weights"] == single_node[0]["weights"]


def test_restart_resumes_from_the_snapshot_and_ends_where_an_uninterrupted_run_does(
    tmp_path, single_node
) -> None:
    done = subprocess.run(
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
            "--result",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "crashed").exists(), "rank 1 was killed once"
    assert "resuming from the snapshot of epoch 0" in done.stdout
    resumed = results(tmp_path / "run", 2)
    assert resumed[0]["weights"] == single_node[0]["weights"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("run")) == [
        "crashed",
        "snap.pt",
    ], "no partial snapshot left behind"
