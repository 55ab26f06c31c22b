"""The GPU paths: NCCL launches, per-GPU memory, SyncBatchNorm, the bench and the notebooks.

Run them on a machine with GPUs with ``python -m pytest -m gpu``. Every test here is marked
``gpu`` and is skipped, saying how many GPUs it needs and how many this machine has, where CUDA
sees too few; nothing here can pass by accident on a CPU machine.

The GPU count comes from ``torch.cuda.device_count()``, which asks NVML and does not initialize
CUDA in this process; the one test that needs CUDA initialized here does it on purpose.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction

import mgtutor
from mgtutor.parallel.syncbn import convert_sync_batchnorm

SYNCBN = "mgtutor.parallel.syncbn.SyncBatchNorm"  # the class's full name, as a rank reports it

REPO = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count()
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
MiB = 2**20

pytestmark = pytest.mark.gpu


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless CUDA sees at least ``count`` GPUs, and say how many there are."""
    noun = "CUDA GPU" if count == 1 else "CUDA GPUs"
    return pytest.mark.skipif(count > GPUS, reason=f"needs {count} {noun}; this machine has {GPUS}")


def _run_python(code: str, timeout: float) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (whose CUDA state we can inspect); parse its JSON."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- launch on every GPU with NCCL --------------------------------------------------------


def _rank_on_its_gpu() -> dict[str, Any]:
    device = mgtutor.setup()
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    return {
        "device": str(device),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "current_device": torch.cuda.current_device(),
        "tensor_device": str(total.device),
        "backend": dist.get_backend(),
        "total": total.item(),
    }


def _assert_every_rank_on_its_gpu(run: mgtutor.Run, world: int) -> None:
    assert run.backend == "nccl" and run.world_size == world
    for rank, result in enumerate(run.results):
        assert result == {
            "device": f"cuda:{rank}",
            "local_rank": rank,
            "current_device": rank,
            "tensor_device": f"cuda:{rank}",
            "backend": "nccl",
            "total": world * (world + 1) / 2,
        }
        assert run.ranks[rank].device == f"cuda:{rank}"


@needs_gpus(1)
def test_launch_on_every_gpu_with_nccl() -> None:
    run = mgtutor.launch(_rank_on_its_gpu, world_size=GPUS, backend="nccl", timeout=120)
    _assert_every_rank_on_its_gpu(run, GPUS)


# --- the hang doctor reads NCCL's own recorder --------------------------------------------


def _nccl_record(skip: bool) -> Any:
    """All-reduce on the GPU; with ``skip``, rank 1 never calls the second one and waits."""
    import time

    from mgtutor import doctor

    device = mgtutor.setup()
    total = torch.ones(4, device=device)
    dist.all_reduce(total)
    if not skip:
        torch.cuda.synchronize()
        return doctor.own_dump(stack_traces=False)
    if dist.get_rank() == 0:
        dist.all_reduce(total)  # NCCL returns at once; the GPU waits for rank 1
    time.sleep(120)
    return None


@needs_gpus(1)
def test_the_doctor_reads_nccls_recorder_not_gloos() -> None:
    # NCCL writes to its own recorder (_dump_nccl_trace); gloo's (_dump_fr_trace) stays empty.
    run = mgtutor.launch(_nccl_record, False, world_size=1, backend="nccl", timeout=120)
    trace = run.results[0]["trace"]
    assert "nccl" in trace["recorders"], trace
    names = [e["profiling_name"] for e in trace["entries"]]
    assert names[-1:] == ["nccl:all_reduce"], trace
    # NCCL's watchdog marks an entry completed when it next polls: any state may show here.
    assert trace["entries"][-1]["state"] in ("scheduled", "started", "completed"), trace


@needs_gpus(2)
def test_the_doctor_names_a_rank_that_skips_an_nccl_collective() -> None:
    with pytest.raises(mgtutor.WorkerTimeout) as info:
        mgtutor.launch(_nccl_record, True, world_size=2, backend="nccl", timeout=20)
    found = info.value.diagnosis
    text = str(info.value)
    assert found is not None and found.kind == "behind", text
    assert found.summary.startswith("rank 1 never reached all_reduce #2, which rank 0 is "), text
    assert "on rank 0, all_reduce #2 is " in text and "on the GPU and has not completed" in text


@needs_gpus(1)
def test_launch_after_cuda_was_used_in_the_calling_process() -> None:
    # The notebook kernel often holds a CUDA context already (notebook 01 runs DataParallel in
    # it); ranks started by fork would then fail with "Cannot re-initialize CUDA".
    torch.ones(1, device="cuda").add_(1)
    assert torch.cuda.is_initialized()
    run = mgtutor.launch(_rank_on_its_gpu, world_size=GPUS, backend="nccl", timeout=120)
    _assert_every_rank_on_its_gpu(run, GPUS)


@needs_gpus(1)
def test_cuda_tensors_come_back_on_the_cpu_and_the_caller_never_initializes_cuda() -> None:
    # launch's docstring promises it: rank results are moved off the GPU before they are sent.
    got = _run_python(
        f"""
        import json, torch, mgtutor
        import torch.distributed as dist

        def work():
            device = mgtutor.setup()
            return torch.full((2,), float(dist.get_rank()), device=device)

        run = mgtutor.launch(work, world_size={GPUS}, backend="nccl", timeout=120)
        print(json.dumps({{
            "devices": [str(t.device) for t in run.results],
            "values": [t.tolist() for t in run.results],
            "cuda_initialized": torch.cuda.is_initialized(),
        }}))
        """,
        timeout=300,
    )
    assert got["devices"] == ["cpu"] * GPUS
    assert got["values"] == [[float(r)] * 2 for r in range(GPUS)]
    assert got["cuda_initialized"] is False


# --- per-GPU memory in the Run ------------------------------------------------------------


def _allocate(unit: int) -> int:
    """Hold (rank + 1) * unit bytes on this rank's GPU, so each rank's figure is its own."""
    device = mgtutor.setup()
    nbytes = (dist.get_rank() + 1) * unit
    block = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    torch.cuda.synchronize(device)
    return block.numel() * block.element_size()


@needs_gpus(1)
def test_memory_figures_are_per_gpu() -> None:
    run = mgtutor.launch(_allocate, 64 * MiB, world_size=GPUS, backend="nccl", timeout=120)
    for rank, result in enumerate(run.ranks):
        memory = result.memory
        assert result.result == (rank + 1) * 64 * MiB
        assert memory.is_cuda and memory.device == f"cuda:{rank}"
        assert memory.peak_allocated > 0 and memory.peak_reserved > 0
        assert memory.peak_allocated >= result.result
        # Less than one more unit: the figure is this rank's GPU, not another rank's.
        assert memory.peak_allocated < result.result + 64 * MiB
        assert memory.peak_reserved >= memory.peak_allocated
        assert memory.headline() == memory.peak_reserved


# --- torch's SyncBatchNorm against mgtutor's, on 2 GPUs -----------------------------------

SPLIT = (3, 5)  # uneven on purpose: the global statistics must weight ranks by their counts


def _syncbn_case() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    layer = nn.BatchNorm2d(3, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5, generator=gen)
        layer.bias.uniform_(-1, 1, generator=gen)
    return {
        "state": layer.state_dict(),
        "x": 3 + 2 * torch.randn(8, 3, 4, 5, generator=gen, dtype=torch.float64),
        "dy": torch.randn(8, 3, 4, 5, generator=gen, dtype=torch.float64),
    }


def _train_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * dy).sum().backward()
    return {
        "type": f"{type(layer).__module__}.{type(layer).__name__}",
        "y": y.detach().cpu(),
        "x_grad": x.grad.cpu(),
        "weight_grad": layer.weight.grad.cpu(),
        "bias_grad": layer.bias.grad.cpu(),
        "running_mean": layer.running_mean.cpu(),
        "running_var": layer.running_var.cpu(),
    }


def _syncbn_three_ways(case: dict[str, Any]) -> dict[str, Any]:
    device = mgtutor.setup()
    rank = dist.get_rank()
    lo = sum(SPLIT[:rank])
    x, dy = case["x"][lo : lo + SPLIT[rank]], case["dy"][lo : lo + SPLIT[rank]]

    def batchnorm() -> nn.Module:
        layer = nn.BatchNorm2d(3, dtype=torch.float64)
        layer.load_state_dict(case["state"])
        return layer

    out: dict[str, Any] = {}
    with mock.patch.object(
        TorchSyncBatchNormFunction, "apply", wraps=TorchSyncBatchNormFunction.apply
    ) as torch_kernels:
        out["converted after .to(device)"] = _train_step(
            convert_sync_batchnorm(batchnorm().to(device)), x.to(device), dy.to(device)
        )
        out["converted after, torch's kernels"] = torch_kernels.call_count
        torch_kernels.reset_mock()
        out["converted before .to(device)"] = _train_step(
            convert_sync_batchnorm(batchnorm()).to(device), x.to(device), dy.to(device)
        )
        out["converted before, torch's kernels"] = torch_kernels.call_count
        torch_kernels.reset_mock()
        # mgtutor's own implementation, on CPU tensors over a gloo group of the same ranks.
        gloo = dist.new_group(backend="gloo")
        out["mgtutor on the CPU"] = _train_step(
            convert_sync_batchnorm(batchnorm(), process_group=gloo), x, dy
        )
        out["CPU, torch's kernels"] = torch_kernels.call_count
    return out


@needs_gpus(2)
def test_torch_syncbatchnorm_and_mgtutor_syncbatchnorm_agree_on_two_gpus() -> None:
    case = _syncbn_case()
    ranks = mgtutor.launch(
        _syncbn_three_ways, case, world_size=2, backend="nccl", timeout=120
    ).results
    reference = nn.BatchNorm2d(3, dtype=torch.float64)
    reference.load_state_dict(case["state"])
    expected = _train_step(reference, case["x"], case["dy"])

    for rank in ranks:
        assert (
            rank["converted after .to(device)"]["type"]
            == "torch.nn.modules.batchnorm.SyncBatchNorm"
        )
        assert rank["converted after, torch's kernels"] == 1
        # Converted on the CPU, then moved: mgtutor's class, running torch's kernels on a GPU.
        assert rank["converted before .to(device)"]["type"] == SYNCBN
        assert rank["converted before, torch's kernels"] == 1
        assert rank["mgtutor on the CPU"]["type"] == SYNCBN
        assert rank["CPU, torch's kernels"] == 0
    for way in (
        "converted after .to(device)",
        "converted before .to(device)",
        "mgtutor on the CPU",
    ):
        got = [rank[way] for rank in ranks]
        for name in ("y", "x_grad"):
            torch.testing.assert_close(
                torch.cat([g[name] for g in got]), expected[name], **TOLERANCE
            )
        for name in ("weight_grad", "bias_grad"):
            # Each rank's parameter gradient covers its own samples; DDP adds them up.
            torch.testing.assert_close(got[0][name] + got[1][name], expected[name], **TOLERANCE)
        for name in ("running_mean", "running_var"):
            for g in got:
                torch.testing.assert_close(g[name], expected[name], **TOLERANCE)


# --- the bandwidth benchmark on NCCL ------------------------------------------------------


@needs_gpus(2)
def test_bench_on_nccl_measures_in_the_ranks_only() -> None:
    got = _run_python(
        f"""
        import json, torch
        from mgtutor import bench

        result = bench.measure_allreduce({GPUS}, [4096, 16 * 2**20], backend="nccl")
        print(json.dumps({{
            "backend": result.backend, "device": result.device, "world": result.world_size,
            "sizes": [p.size for p in result.points],
            "algbw": [p.algbw for p in result.points], "busbw": [p.busbw for p in result.points],
            "copy": result.copy_bandwidth, "copy_size": result.copy_size,
            "cuda_initialized": torch.cuda.is_initialized(),
        }}))
        """,
        timeout=300,
    )
    assert (got["backend"], got["device"], got["world"]) == ("nccl", "cuda", GPUS)
    assert got["sizes"] == [4096, 16 * MiB] and got["copy_size"] == 16 * MiB
    assert all(b > 0 for b in got["algbw"] + got["busbw"]) and got["copy"] > 0
    # The copy reference ran in rank 0, on its GPU: this process never touched CUDA.
    assert got["cuda_initialized"] is False


# --- a forkserver, if the launcher has one ------------------------------------------------

HAS_START_METHOD = "start_method" in inspect.signature(mgtutor.launch).parameters


@needs_gpus(1)
@pytest.mark.skipif(
    not HAS_START_METHOD, reason="mgtutor.launch has no start_method argument (no forkserver)"
)
def test_forkserver_never_initializes_cuda() -> None:
    # Ranks forked from a server that had initialized CUDA cannot use their GPU. What counts is
    # the server's CUDA state, not which libraries it maps: with torch 2.11.0+cu130 `import
    # torch` alone maps libcuda.so. A forked rank starts with a copy of the server's memory, so
    # before it touches CUDA it holds the server's torch.cuda._initialized, and torch's fork
    # handler (registered when CUDA is initialized) has marked it "in bad fork" if the server
    # had. The caller uses CUDA first, as a notebook that ran a GPU cell has; two launches, the
    # second reusing the server the first one started.
    got = _run_python(
        f"""
        import json, os, torch, torch.distributed as dist, mgtutor

        def work():
            # Private names (torch 2.11-2.15 have both): None where a torch lacks one, and
            # then the all-reduce on the rank's GPU below is the check that is left.
            bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: None)
            server = {{"initialized": getattr(torch.cuda, "_initialized", None),
                      "bad_fork": bad_fork()}}
            device = mgtutor.setup()
            total = torch.tensor([float(dist.get_rank() + 1)], device=device)
            dist.all_reduce(total)
            return {{"server": server, "device": str(device), "tensor_device": str(total.device),
                    "total": total.item(), "parent": os.getppid()}}

        torch.ones(1, device="cuda").add_(1)
        caller = torch.cuda.is_initialized()
        runs = [mgtutor.launch(work, world_size={GPUS}, backend="nccl",
                               start_method="forkserver", timeout=120).results for _ in range(2)]
        print(json.dumps({{"caller": caller, "pid": os.getpid(), "runs": runs}}))
        """,
        timeout=600,
    )
    assert got["caller"] is True, "the calling process used CUDA before the launches"
    parents = {rank["parent"] for run in got["runs"] for rank in run}
    assert len(parents) == 1 and got["pid"] not in parents, "not forked from one server"
    for run in got["runs"]:
        for rank, result in enumerate(run):
            assert set(result["server"].values()) <= {False, None}, result
            assert result["device"] == result["tensor_device"] == f"cuda:{rank}"
            assert result["total"] == GPUS * (GPUS + 1) / 2


# --- the notebooks on the GPU path --------------------------------------------------------


@needs_gpus(1)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("number", ["01", "02", "03", "04", "05", "06", "07", "08"])
def test_notebook_runs_under_nbval_on_gpus(number: str) -> None:
    (notebook,) = (REPO / "notebooks").glob(f"{number}_*.ipynb")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval-lax",
            "--nbval-current-env",
            "-q",
            str(notebook.relative_to(REPO)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
