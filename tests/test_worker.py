"""setup() and the environment contract, in this process: torchrun's variables and SLURM's."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import mgtutor

LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_ID",
    "MGTUTOR_BACKEND",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@pytest.fixture
def clean_env(monkeypatch):
    saved = dict(os.environ)  # setup() under SLURM writes RANK etc. itself: restore everything
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MGTUTOR_BACKEND", "gloo")  # CPU tests: gloo on a GPU machine too
    threads = torch.get_num_threads()
    yield monkeypatch
    mgtutor.teardown()
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(saved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_contract_from_torchrun_variables(clean_env) -> None:
    clean_env.setenv("RANK", "3")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "29400")
    clean_env.setenv("SLURM_PROCID", "0")  # srun + torchrun: torchrun's per-worker values win
    c = mgtutor.get_contract()
    assert (c.rank, c.local_rank, c.world_size, c.local_world_size) == (3, 1, 4, 2)
    assert (c.master_addr, c.master_port, c.source) == ("10.0.0.1", 29400, "torchrun")


def test_contract_from_slurm_variables(clean_env) -> None:
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_NTASKS_PER_NODE", "4")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    clean_env.setenv("MASTER_ADDR", "node01")
    c = mgtutor.get_contract()
    assert (c.rank, c.local_rank, c.world_size, c.local_world_size) == (5, 1, 8, 4)
    assert c.source == "slurm"
    assert c.master_port == 15000 + 123456 % 20000, "a port derived from the job id"


def test_slurm_without_master_addr_says_what_to_export(clean_env) -> None:
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "2")
    with pytest.raises(RuntimeError, match=r"export MASTER_ADDR=\$\(scontrol show hostnames"):
        mgtutor.get_contract()


def test_no_launcher_variables_is_a_clear_error(clean_env) -> None:
    with pytest.raises(RuntimeError, match="not in the notebook itself"):
        mgtutor.setup()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "two", "WORLD_SIZE": "2"}, "RANK='two' is not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "outside 0..1"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ],
)
def test_bad_contracts(clean_env, env, match) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises((ValueError, RuntimeError), match=match):
        mgtutor.get_contract()


def test_setup_and_teardown_as_a_single_torchrun_worker(clean_env) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    device = mgtutor.setup()
    assert device == torch.device("cpu") and mgtutor.setup() == device
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    mgtutor.teardown()
    assert not dist.is_initialized()


def test_setup_under_slurm_exports_the_torchrun_names(clean_env) -> None:
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_LOCALID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    mgtutor.setup()
    assert dist.get_rank() == 0 and dist.get_world_size() == 1
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == (
        "0",
        "0",
        "1",
    )


def test_setup_refuses_unknown_backend_and_device(clean_env) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        mgtutor.setup("mpi")
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or None"):
        mgtutor.setup(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_backend_for_a_machine_without_gpus(clean_env) -> None:
    assert mgtutor.backend_for(1) == mgtutor.backend_for(8) == "gloo"
    hw = mgtutor.describe_hardware()
    assert hw.gpus == () and hw.backend_for(2) == "gloo" and hw.device_for(2) == "cpu"
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        mgtutor.setup("nccl")


def test_no_launcher_variable_leaks_out_of_these_tests() -> None:
    # The notebooks' kernels inherit pytest's environment: a leaked RANK changes what they see.
    # (conftest sets MGTUTOR_BACKEND=gloo for each unit test, this one too, and undoes it.)
    assert os.environ.get("MGTUTOR_BACKEND") == "gloo"
    assert not [name for name in LAUNCHER_VARS if name in os.environ and name != "MGTUTOR_BACKEND"]


def test_describe_hardware_matches_torch_and_the_os() -> None:
    import psutil

    hw = mgtutor.describe_hardware()
    assert hw.cpu_cores == len(os.sched_getaffinity(0))
    assert hw.memory_bytes == psutil.virtual_memory().total
    assert hw.torch_version == torch.__version__
    assert len(hw.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert hw.gloo_available and "CPU cores" in repr(hw)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="SKIPPED: needs at least 2 CUDA GPUs (this machine has fewer)",
)
def test_nccl_launch_on_two_gpus() -> None:
    def work() -> tuple:
        device = mgtutor.setup()
        t = torch.ones(1, device=device) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        big = torch.empty(256, 1024, 1024, device=device)  # 1 GiB
        del big
        return str(device), dist.get_backend(), t.item()

    run = mgtutor.launch(work, world_size=2)
    assert run.results == [("cuda:0", "nccl", 3.0), ("cuda:1", "nccl", 3.0)]
    for r in run.ranks:
        assert r.memory.is_cuda and r.memory.peak_allocated >= 2**30
        assert r.memory.peak_reserved >= r.memory.peak_allocated


def test_importing_mgtutor_does_not_import_torch() -> None:
    # Every worker imports mgtutor before anything else; torch's import is the launch's floor.
    import subprocess
    import sys

    code = "import sys, mgtutor; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "False"], done.stderr
    assert set(mgtutor.__all__) <= set(dir(mgtutor))
    for name in mgtutor.__all__:  # the lazily loaded ones too
        assert getattr(mgtutor, name) is not None


def test_threads_per_rank_divide_shared_cores_but_not_a_slurm_tasks_own(monkeypatch) -> None:
    from mgtutor import hardware, worker

    monkeypatch.setattr(hardware, "usable_cores", lambda: 8)

    def contract(source: str) -> worker.WorkerContract:
        return worker.WorkerContract(0, 0, 4, 4, "h", 1, source)

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert worker._threads_per_rank(contract("torchrun")) == 2  # 4 ranks share 8 cores
    assert worker._threads_per_rank(contract("slurm")) == 2  # no binding said: share them
    # srun --cpus-per-task=8 binds each task to 8 cores of its own: all 8 are this rank's.
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert worker._threads_per_rank(contract("slurm")) == 8
    # torchrun under srun (one task per node): its workers share the task's cores.
    assert worker._threads_per_rank(contract("torchrun")) == 2


def _destroy_with_a_python_callback_pending(destroy_in_fn: bool) -> tuple[str, bool]:
    import time

    mgtutor.setup()
    work = dist.all_reduce(torch.ones(1 << 14), async_op=True)
    # A Python callback on the collective's future, still to run on gloo's worker thread.
    work.get_future().then(lambda fut: time.sleep(0.3) or fut.value())
    if destroy_in_fn:
        dist.destroy_process_group()  # the plain program's last line
    return dist.destroy_process_group.__name__, dist.is_initialized()


@pytest.mark.parametrize("destroy_in_fn", [True, False], ids=["fn destroys", "teardown destroys"])
def test_destroying_a_group_with_a_callback_pending_does_not_deadlock(destroy_in_fn) -> None:
    # Before torch 2.8 a process group was destroyed with the GIL held, while gloo's worker
    # thread needed the GIL to run the callback: every rank hung there, every time (torch 2.4.1,
    # without mgtutor's guard). mgtutor's ranks keep the group alive instead (worker.py).
    run = mgtutor.launch(_destroy_with_a_python_callback_pending, destroy_in_fn, timeout=30)
    assert run.results == [("destroy_process_group", not destroy_in_fn)] * 2


# --- which backend when GPUs are fewer than ranks, or two "nodes" share a machine ----------


def _mock_gpus(count: int):
    """Patch torch so that CUDA seems to see ``count`` GPUs (and NCCL is there)."""
    from contextlib import ExitStack
    from types import SimpleNamespace
    from unittest import mock

    props = SimpleNamespace(name="Mock GPU", total_memory=80 * 2**30, major=9, minor=0)
    stack = ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "is_available", return_value=count > 0))
    stack.enter_context(mock.patch.object(torch.cuda, "device_count", return_value=count))
    stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", return_value=props))
    stack.enter_context(mock.patch.object(dist, "is_nccl_available", return_value=True))
    stack.enter_context(mock.patch.object(torch.cuda.nccl, "version", return_value=(2, 30, 7)))
    # describe_hardware reads the build's facts once: again under the stand-in, and after it.
    from mgtutor.build import this_build

    this_build.cache_clear()
    stack.callback(this_build.cache_clear)
    return stack


def test_a_one_gpu_machine_says_what_runs_where() -> None:
    with _mock_gpus(1):
        hw = mgtutor.describe_hardware()
    assert [hw.backend_for(n) for n in (1, 2, 4)] == ["nccl", "gloo", "gloo"]
    summary, *rows = hw.what_runs_where()
    assert summary.startswith("CUDA sees 1 GPU: a job of 1 rank runs on the GPU with NCCL")
    assert "more ranks runs on the CPU with gloo" in summary
    assert 'setup("gloo", device="cuda")' in summary and "SKIPPED" in summary
    text = repr(hw)
    assert "GPU 0        Mock GPU, 80.0 GiB" in text
    assert "world_size 2 or more: gloo, every rank on the CPU" in text
    assert 'setup("gloo", device="cuda")' in text and "take turns on it" in text
    assert all(row in text for row in rows)
    with _mock_gpus(2):
        two = mgtutor.describe_hardware()
    assert two.what_runs_where()[0].startswith("CUDA sees 2 GPUs: a job of up to 2 ranks")
    assert "world_size 3 or more: gloo" in repr(two)
    with _mock_gpus(0):
        none = mgtutor.describe_hardware()
    assert none.what_runs_where()[0].startswith("SKIPPED GPU paths: CUDA sees no GPU")
    assert "ranks" not in repr(none)  # the laptop's description is as it was


def test_choose_backend_for_job_wants_a_gpu_of_its_own_for_every_rank() -> None:
    from mgtutor.hardware import RankPlace, choose_backend_for_job

    def job(*places: tuple[str, int, int]) -> str:
        return choose_backend_for_job([RankPlace(h, lr, g, True) for h, lr, g in places])

    assert job(("a", 0, 1), ("b", 0, 1)) == "nccl"  # two machines, a GPU each
    assert job(("a", 0, 1), ("a", 0, 1)) == "gloo"  # two "nodes" on one machine, one GPU
    assert job(("a", 0, 4), ("a", 1, 4), ("a", 0, 4), ("a", 1, 4)) == "gloo"  # ranks repeat
    assert job(("a", 0, 2), ("a", 1, 2), ("b", 0, 1), ("b", 1, 1)) == "gloo"  # b has too few
    no_nccl = [RankPlace("a", 0, 1, True), RankPlace("b", 0, 1, False)]
    assert choose_backend_for_job(no_nccl) == "gloo"


def test_ranks_agree_on_the_backend_through_the_store() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from mgtutor.hardware import RankPlace, agree_on_backend

    def agree(hosts: tuple[str, str]) -> list[str]:
        server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False)
        with ThreadPoolExecutor(2) as pool:
            answers = [
                pool.submit(agree_on_backend, store, rank, 2, RankPlace(hosts[rank], 0, 1, True))
                for rank, store in enumerate((server, client))
            ]
            return [a.result(timeout=30) for a in answers]

    assert agree(("vm", "vm")) == ["gloo", "gloo"]
    assert agree(("node0", "node1")) == ["nccl", "nccl"]


def test_two_nodes_on_one_machine_with_one_gpu_pick_gloo(clean_env) -> None:
    # What failed on a one-GPU machine: two torchrun "nodes" on loopback, one worker each. Each
    # worker's LOCAL_WORLD_SIZE is 1, so each alone would pick NCCL on cuda:0.
    import subprocess
    import sys

    code = (
        "import json, torch, torch.distributed as dist, mgtutor\n"
        "from unittest import mock\n"
        "with mock.patch.object(torch.cuda, 'is_available', return_value=True), "
        "mock.patch.object(torch.cuda, 'device_count', return_value=1), "
        "mock.patch.object(dist, 'is_nccl_available', return_value=True):\n"
        "    alone = mgtutor.backend_for(1)\n"
        "    device = mgtutor.setup()\n"
        "print(json.dumps([alone, dist.get_backend(), str(device)]))\n"
        "mgtutor.teardown()\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "MGTUTOR_BACKEND"}
    env.update(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RANK": str(rank), "GROUP_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=60) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    import json

    assert [json.loads(out) for out, _ in outputs] == [["nccl", "gloo", "cpu"]] * 2
