"""mgtutor.build: the platform facts, read from torch, and every branch the notebooks take on them.

Each branch is tested on this machine's real build and, by standing in for the platform (torch
reporting no NCCL, no CUDA, MPS as its accelerator; macOS; torchvision missing), on the others.
Where DDP or the DataLoader decides, the test asks them, not the build's own rule.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import mgtutor
from mgtutor import build as build_module
from mgtutor.build import (
    Build,
    loader_start_method,
    needs_torchvision,
    rank_start_method,
    this_build,
    torchvision_for,
)
from mgtutor.data import AugmentedImages, CountingDataset, WorkerSeeds, augment, load_cifar10
from mgtutor.errors import ArgumentError, strip_ansi


@pytest.fixture()
def fresh() -> Iterator[None]:
    """this_build() reads anew inside the test (under its stand-ins), and again after it."""
    this_build.cache_clear()
    yield
    this_build.cache_clear()


@pytest.fixture()
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _no_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only wheel: no CUDA compiled in, no NCCL (torch's own functions say so)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)


def _with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build with NCCL 2.30 (the machine need have no GPU)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 30, 7))


def _accelerator(monkeypatch: pytest.MonkeyPatch, kind: str | None) -> None:
    """``kind`` usable now; None as a CUDA build on a machine without a GPU answers: the type
    it was built for, but not available."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: kind is not None)
    device = torch.device(kind or "cuda")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: device)


class _BrokenTorchvision(importlib.abc.MetaPathFinder):
    """A torchvision built for another torch: found, but its import raises."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def test_the_facts_are_torchs_own_answers() -> None:
    build = this_build()
    assert build.torch == torch.__version__ and build.cuda == torch.version.cuda
    assert build.nccl == (dist.is_available() and dist.is_nccl_available())
    assert build.python == tuple(sys.version_info[:3])
    assert build.accelerator == (
        torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    )
    assert this_build() is build  # read once
    hw = mgtutor.describe_hardware()
    assert (hw.torch_version, hw.cuda_build, hw.nccl_available) == (
        build.torch,
        build.cuda,
        build.nccl,
    )
    assert hw.accelerator == build.accelerator
    assert f"accelerator  {build.accelerator or 'none'}" in repr(hw)
    # What it describes is the build's, not torch read again: a stand-in shows through.
    stand_in = dataclasses.replace(build, nccl=not build.nccl, cuda="99.9", accelerator="xpu")
    other = mgtutor.describe_hardware(stand_in)
    assert (other.nccl_available, other.cuda_build, other.accelerator) == (
        not build.nccl,
        "99.9",
        "xpu",
    )


def test_a_build_without_cuda_or_nccl(fresh, monkeypatch) -> None:
    _no_nccl(monkeypatch)
    build = this_build()
    assert (build.cuda, build.nccl, build.nccl_version) == (None, False, None)
    assert not build.bf16_compress_hook_accepted
    assert "no CUDA, no NCCL" in build.describe()
    assert not mgtutor.describe_hardware(build).nccl_available


def test_a_build_with_cuda_and_nccl(fresh, monkeypatch) -> None:
    _with_nccl(monkeypatch)
    build = this_build()
    assert build.nccl and build.nccl_version == (2, 30, 7) and build.bf16_compress_hook_accepted
    older = dataclasses.replace(build, nccl_version=(2, 9, 9))
    assert not older.bf16_compress_hook_accepted  # torch asks for NCCL 2.10 or later


def _ddp_takes(hook: object) -> bool:
    model = DDP(nn.Linear(2, 2))
    try:
        model.register_comm_hook(None, hook)
    except TypeError:
        return False
    return True


def test_ddp_takes_bf16_compress_hook_exactly_where_the_build_says(one_rank_group) -> None:
    assert _ddp_takes(default_hooks.bf16_compress_hook) == this_build().bf16_compress_hook_accepted
    assert _ddp_takes(default_hooks.fp16_compress_hook)  # no build check for float16


@pytest.mark.parametrize("stand_in", [_no_nccl, _with_nccl], ids=["no NCCL", "NCCL"])
def test_ddp_agrees_with_the_build_under_each_stand_in(
    fresh, monkeypatch, one_rank_group, stand_in
) -> None:
    stand_in(monkeypatch)
    accepted = this_build().bf16_compress_hook_accepted
    assert accepted == (stand_in is _with_nccl)
    assert _ddp_takes(default_hooks.bf16_compress_hook) == accepted
    assert _ddp_takes(default_hooks.fp16_compress_hook)


@pytest.mark.parametrize(
    ("kind", "pins"), [(None, False), ("mps", False), ("cuda", True), ("xpu", True)]
)
def test_which_accelerators_the_loader_pins_for(fresh, monkeypatch, kind, pins) -> None:
    _accelerator(monkeypatch, kind)
    build = this_build()
    assert build.accelerator == kind and build.loader_pins_memory is pins
    assert mgtutor.describe_hardware(build).accelerator == kind


def test_the_loader_warns_and_pins_nothing_on_mps(monkeypatch) -> None:
    # The DataLoader's own decision, on a stand-in MPS (no batch is pinned, so no MPS is needed).
    _accelerator(monkeypatch, "mps")
    with pytest.warns(UserWarning, match="MPS"):
        batch = next(iter(DataLoader([torch.zeros(2)], pin_memory=True)))
    assert not batch.is_pinned()
    build = dataclasses.replace(this_build(), accelerator="mps")
    assert not build.loader_pins_memory


PLATFORMS = [
    ("Linux", ("fork", "spawn", "forkserver"), "fork", "forkserver"),
    ("Darwin", ("fork", "spawn", "forkserver"), "spawn", "spawn"),
    ("Windows", ("spawn",), "spawn", "spawn"),
]


def _system(monkeypatch: pytest.MonkeyPatch, system: str, methods: tuple[str, ...]) -> None:
    monkeypatch.setattr(build_module.platform, "system", lambda: system)
    monkeypatch.setattr(
        build_module.multiprocessing, "get_all_start_methods", lambda: list(methods)
    )


@pytest.mark.parametrize(("system", "methods", "start", "ranks"), PLATFORMS)
def test_loader_workers_fork_only_where_it_is_safe(
    fresh, monkeypatch, system, methods, start, ranks
):
    _system(monkeypatch, system, methods)
    build = this_build()
    assert build.os == system and build.loader_start_method == start == loader_start_method()
    assert build.fork_safe is (start == "fork")


@pytest.mark.parametrize(("system", "methods", "start", "ranks"), PLATFORMS)
def test_ranks_start_from_a_forkserver_only_where_forking_is_safe(
    fresh, monkeypatch, system, methods, start, ranks
):
    from mgtutor.launcher import _arguments

    _system(monkeypatch, system, methods)
    assert this_build().rank_start_method == ranks == rank_start_method()
    assert _arguments.default_start_method() == ranks
    _arguments.check_arguments(2, "gloo", 10, "spawn")  # spawn is offered everywhere
    if ranks == "forkserver":
        _arguments.check_arguments(2, "gloo", 10, "forkserver")
    else:
        with pytest.raises(ArgumentError, match="start_method='spawn'"):
            _arguments.check_arguments(2, "gloo", 10, "forkserver")


def test_on_macos_a_kernel_starts_no_forkserver_early(fresh, monkeypatch) -> None:
    import mgtutor
    from mgtutor.launcher import _processes

    started = []
    monkeypatch.setattr(_processes, "start_server_early", lambda: started.append(True))
    monkeypatch.setitem(sys.modules, "ipykernel", sys.modules.get("ipykernel") or object())
    monkeypatch.delenv("MGTUTOR_EARLY_SERVER", raising=False)
    _system(monkeypatch, "Linux", ("fork", "spawn", "forkserver"))
    mgtutor._start_server_in_a_kernel()
    assert started == [True]
    _system(monkeypatch, "Darwin", ("fork", "spawn", "forkserver"))
    mgtutor._start_server_in_a_kernel()
    assert started == [True]


def test_a_pool_on_macos_spawns_its_ranks(fresh, monkeypatch) -> None:
    _system(monkeypatch, "Darwin", ("fork", "spawn", "forkserver"))
    with mgtutor.Pool(1, backend="gloo", idle_timeout=None) as pool:
        assert pool.start_method == "spawn"
        assert pool.run(lambda: __import__("multiprocessing").get_start_method()).results == [
            "spawn"
        ]


def test_spawned_workers_read_the_notebooks_datasets() -> None:
    # macOS's way, on any machine: a spawned worker imports each dataset's class by name.
    spawn = {"num_workers": 1, "multiprocessing_context": "spawn"}
    images = [x for x, _, _ in DataLoader(AugmentedImages(8), batch_size=4, **spawn)]
    assert torch.cat(images).shape == (8, 3, 32, 32)
    seeds = [row.tolist() for b in DataLoader(WorkerSeeds(), batch_size=2, **spawn) for row in b]
    assert [row[0] for row in seeds] == [0] * 4 and all(r[1] == r[2] for r in seeds)
    counting = CountingDataset(16, "spawn")
    assert sum(len(b) for b in DataLoader(counting, batch_size=4, **spawn)) == 16
    assert counting.loaded.value == 16  # the worker counted into the notebook's shared memory


def test_the_exercise_sends_a_learners_function_to_spawned_workers() -> None:
    from mgtutor.exercises.shard_indices import _Stream

    def mine(n, rank, world, worker, workers):  # local: no worker could import it by name
        return list(range(worker, n, workers))

    stream = pickle.loads(pickle.dumps(_Stream(mine, 6, 0, 1)))
    assert stream.fn(6, 0, 1, 0, 1) == list(range(6))
    loader = DataLoader(_Stream(mine, 6, 0, 1), num_workers=2, multiprocessing_context="spawn")
    assert sorted(int(sample) for _, sample in loader) == list(range(6))


def test_augment_follows_torchs_seed() -> None:
    image = torch.linspace(0, 1, 3 * 16 * 16).reshape(3, 16, 16)
    torch.manual_seed(3)
    a = augment(image)
    torch.manual_seed(3)
    assert torch.equal(a, augment(image)) and a.shape == (3, 32, 32)
    assert not torch.equal(a, augment(image))  # a fresh draw after it


def test_a_missing_torchvision_is_skipped_and_its_install_named(fresh, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` fails
    build = this_build()
    assert build.torchvision is None and "torchvision" in build.torchvision_error
    assert not needs_torchvision("counting ResNet-50's layers")
    said = capsys.readouterr().out
    assert said.startswith("SKIPPED: counting ResNet-50's layers needs torchvision")
    assert build.torchvision_install in said
    with pytest.raises(ImportError, match="load_cifar10 needs torchvision"):
        load_cifar10("nowhere")


def test_a_torchvision_that_does_not_import_counts_as_missing(fresh, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchvision(), *sys.meta_path])
    build = this_build()
    assert build.torchvision is None and build.torchvision_error.startswith("RuntimeError")


@pytest.mark.skipif(this_build().torchvision is None, reason="torchvision does not import here")
def test_a_torchvision_that_imports_runs_the_cell(capsys) -> None:
    assert needs_torchvision("anything") and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("torch_version", "command"),
    [
        ("2.14.1", "pip install torchvision==0.29.1"),
        (
            "2.13.0+cpu",
            "pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu",
        ),
        (
            "2.11.0+cu130",
            "pip install torchvision==0.26.0 --index-url https://download.pytorch.org/whl/cu130",
        ),
        (
            "2.16.0.dev20260101+cpu",
            "pip install --pre torchvision --index-url https://download.pytorch.org/whl/nightly/cpu",
        ),
    ],
)
def test_the_torchvision_made_for_each_torch(torch_version: str, command: str) -> None:
    assert torchvision_for(torch_version) == command


def test_a_build_is_a_plain_record() -> None:
    assert dataclasses.is_dataclass(Build) and Build.__dataclass_params__.frozen


# A traceback as Python 3.13 prints it where FORCE_COLOR is set (its last two lines).
COLOURED = (
    "    \x1b[31m~\x1b[0m\x1b[1;31m^\x1b[0m\x1b[31m~\x1b[0m\n"
    "\x1b[1;35mZeroDivisionError\x1b[0m: \x1b[35mdivision by zero\x1b[0m\n"
)


def test_strip_ansi_gives_a_coloured_traceback_plain() -> None:
    assert strip_ansi(COLOURED).splitlines() == ["    ~^~", "ZeroDivisionError: division by zero"]
    # And a live one: under the kernel's FORCE_COLOR=1, Python 3.13 colours it (3.11 does not).
    env = {**os.environ, "FORCE_COLOR": "1"}
    env.pop("NO_COLOR", None)
    env.pop("PYTHON_COLORS", None)
    done = subprocess.run([sys.executable, "-c", "1/0"], env=env, capture_output=True, text=True)
    assert ("\x1b[" in done.stderr) == (sys.version_info >= (3, 13))
    assert strip_ansi(done.stderr).splitlines()[-1] == "ZeroDivisionError: division by zero"


def _raise_coloured() -> None:
    raise ValueError("\x1b[31mno such shard\x1b[0m")


def test_a_ranks_coloured_message_reaches_the_notebook_plain() -> None:
    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(_raise_coloured, world_size=1, timeout=60)
    error = info.value
    assert error.exc_message == "no such shard" and "raised ValueError: no such shard" in str(error)
    assert "\x1b" not in error.worker_traceback


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0a0+git1234abc", (2, 13)), ("2.14.1+cu130", (2, 14)), ("2.4.1", (2, 4))],
)
def test_version_gates_read_the_release_a_nightly_has(version: str, release: tuple) -> None:
    from torch.torch_version import TorchVersion

    assert build_module.torch_release(version) == release
    # What a gate written against torch.__version__ would have said of a nightly of 2.13:
    assert (TorchVersion(version) >= release) is ("a0" not in version)
