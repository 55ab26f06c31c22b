"""What this machine offers a data-parallel job: cores, memory, GPUs and backends.

Notebook 00 starts here: :func:`describe_hardware` says which GPUs CUDA sees and which backend
:func:`mgtutor.setup` will pick for each world size, so a learner knows which path of each
notebook will run (the real GPU one, or the CPU one with gloo), and what a machine with fewer GPUs
than ranks does. :func:`choose_backend` is the rule for one launcher's workers,
:func:`choose_backend_for_job` the rule when several launchers (torchrun's nodes) may share a
machine, and :func:`agree_on_backend` lets a job's ranks apply it together.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mgtutor.build import Build

__all__ = ["GpuInfo", "HardwareInfo", "RankPlace", "describe_hardware", "loopback_interface"]


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a job runs: its machine, its local rank, what that machine offers."""

    host: str
    local_rank: int
    gpus: int
    nccl_available: bool


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as torch sees it."""

    index: int
    name: str
    total_memory: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class HardwareInfo:
    """This machine, as the workbook needs to know it.

    Attributes:
        cpu_cores: cores this process may run on.
        memory_bytes: total physical memory.
        gpus: the CUDA devices torch sees (empty on a laptop).
        torch_version: torch's version string.
        cuda_build: the CUDA version torch was built with, or None for a CPU-only build.
        gloo_available: whether torch.distributed has gloo (CPU, any machine).
        nccl_available: whether torch.distributed has NCCL (GPU, Linux).
        platform: the operating system and processor.
        accelerator: the accelerator torch can use ("cuda", "mps", "xpu"), None without one.
    """

    cpu_cores: int
    memory_bytes: int
    gpus: tuple[GpuInfo, ...]
    torch_version: str
    cuda_build: str | None
    gloo_available: bool
    nccl_available: bool
    platform: str
    accelerator: str | None = None

    def backend_for(self, world_size: int) -> str:
        """The backend :func:`mgtutor.setup` picks for ``world_size`` ranks on this machine."""
        return choose_backend(len(self.gpus), self.nccl_available, world_size)

    def device_for(self, world_size: int) -> str:
        """Where each rank computes by default for ``world_size`` ranks on this machine."""
        return "cuda:LOCAL_RANK" if self.backend_for(world_size) == "nccl" else "cpu"

    def _lines(self) -> list[str]:
        from mgtutor.units import format_bytes

        lines = [
            f"platform     {self.platform}",
            f"torch        {self.torch_version} (CUDA build: {self.cuda_build or 'none'})",
            f"CPU cores    {self.cpu_cores}",
            f"memory       {format_bytes(self.memory_bytes)}",
            f"backends     gloo: {'yes' if self.gloo_available else 'no'}, "
            f"nccl: {'yes' if self.nccl_available else 'no'}",
            f"accelerator  {self.accelerator or 'none'}",
        ]
        if self.gpus:
            for g in self.gpus:
                lines.append(
                    f"GPU {g.index}        {g.name}, {format_bytes(g.total_memory)}, "
                    f"compute capability {g.capability[0]}.{g.capability[1]}"
                )
        else:
            lines.append("GPUs         none visible to CUDA: every rank will be a CPU process")
        for i, line in enumerate(self.what_runs_where()[1:]):
            lines.append(f"{'ranks' if i == 0 else '':13s}{line}")
        return lines

    def what_runs_where(self) -> list[str]:
        """Say, in plain words, where ranks run on this machine and what a GPU cell will do.

        The first line sums it up (notebook 00 prints it); the others, which the description
        prints, say which world sizes get NCCL, which fall back to gloo on the CPU, and how ranks
        can share the GPUs instead. Without a GPU there is only the first line.
        """
        gpus = len(self.gpus)
        if gpus == 0:
            return [
                "SKIPPED GPU paths: CUDA sees no GPU on this machine. Cells that need GPUs say"
                " SKIPPED and why; the CPU path (gloo, one process per rank) runs everywhere else."
            ]
        noun = "1 GPU" if gpus == 1 else f"{gpus} GPUs"
        share = 'setup("gloo", device="cuda")'
        if not self.nccl_available:
            return [
                f"CUDA sees {noun}, but this torch has no NCCL: every job runs on the CPU with "
                f"gloo unless its ranks use the GPUs through gloo ({share}).",
                f"gloo, every rank on the CPU; {share} puts the ranks on the GPUs (round-robin)",
            ]
        few = "a job of 1 rank" if gpus == 1 else f"a job of up to {gpus} ranks"
        return [
            f"CUDA sees {noun}: {few} runs on the GPU with NCCL, a GPU per rank; a job of more "
            f"ranks runs on the CPU with gloo unless its ranks share the GPU ({share}); cells "
            "that need more GPUs than this say SKIPPED and why.",
            f"world_size 1 to {gpus}: NCCL, a GPU of its own for each rank"
            if gpus > 1
            else "world_size 1: NCCL on GPU 0",
            f"world_size {gpus + 1} or more: gloo, every rank on the CPU (NCCL refuses two ranks "
            "on one GPU)",
            f"or share: {share} in each rank puts it on a GPU (round-robin); ranks on one GPU",
            "take turns on it and split its memory: not the timings or memory of a GPU per rank",
        ]

    def __repr__(self) -> str:
        return "\n".join(self._lines())


def choose_backend(gpus: int, nccl_available: bool, local_ranks: int) -> str:
    """The one rule for the default backend: NCCL with a GPU per local rank, else gloo.

    NCCL refuses two ranks on one GPU, so fewer GPUs than ranks on a machine means gloo.
    :func:`mgtutor.backend_for` (live, in a rank) and :meth:`HardwareInfo.backend_for` (from a
    description) both answer with it.
    """
    return "nccl" if nccl_available and gpus >= local_ranks else "gloo"


def choose_backend_for_job(ranks: Sequence[RankPlace]) -> str:
    """The rule for a job whose ranks may share a machine across launchers: NCCL or gloo for all.

    Two torchrun agents on one machine (two "nodes" on loopback) each count only their own
    workers in ``LOCAL_WORLD_SIZE``, and their workers' ``LOCAL_RANK``s repeat: both agents'
    local rank 0 would take GPU 0, which NCCL refuses. So NCCL only when, on every machine, the
    ranks there have different local ranks and each has a GPU of its own (local rank < GPUs).

    Args:
        ranks: where each rank of the job runs, as each rank reported it.

    Returns:
        "nccl" or "gloo", the same answer for every rank.

    Example:
        >>> two_nodes_on_one_host = [RankPlace("vm", 0, 1, True), RankPlace("vm", 0, 1, True)]
        >>> choose_backend_for_job(two_nodes_on_one_host)
        'gloo'
    """
    by_host: dict[str, list[RankPlace]] = {}
    for place in ranks:
        by_host.setdefault(place.host, []).append(place)
    for places in by_host.values():
        local_ranks = [p.local_rank for p in places]
        if len(set(local_ranks)) < len(local_ranks):
            return "gloo"
        if not all(p.nccl_available and 0 <= p.local_rank < p.gpus for p in places):
            return "gloo"
    return "nccl"


def agree_on_backend(store: Any, rank: int, world_size: int, place: RankPlace) -> str:
    """Tell every rank where this one runs, through ``store``; all return the same backend.

    Args:
        store: a store every rank of the job reaches (the rendezvous store).
        rank, world_size: this rank's place in the job.
        place: this rank's machine, local rank, GPU count and NCCL support.

    Returns:
        :func:`mgtutor.hardware.choose_backend_for_job` of every rank's place.
    """
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart sees fresh keys
    board = dist.PrefixStore(f"mgtutor/places/{attempt}", store)
    board.set(str(rank), json.dumps(dataclasses.asdict(place)))
    keys = [str(r) for r in range(world_size)]
    board.wait(keys)
    return choose_backend_for_job([RankPlace(**json.loads(board.get(key))) for key in keys])


def loopback_interface() -> str | None:
    """The name of the network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS).

    gloo picks its interface from ``GLOO_SOCKET_IFNAME``, or else from the address the hostname
    resolves to, which on a laptop on a VPN may be one its peers cannot reach: ranks on one
    machine pin it to this one.
    """
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask, or every core on macOS.

    A container, ``taskset`` or a batch scheduler can allow fewer cores than the machine has;
    ``os.cpu_count()`` would count them all.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def describe_hardware(build: Build | None = None) -> HardwareInfo:
    """Look at this machine without starting any worker.

    Args:
        build: the build's facts; :func:`mgtutor.build.this_build` by default (a test passes a
            stand-in, a build with NCCL for instance).

    Returns:
        A :class:`HardwareInfo`; it prints as a short table.

    Example:
        >>> hw = describe_hardware()
        >>> hw.backend_for(2)
        'gloo'
    """
    import psutil
    import torch
    import torch.distributed as dist

    from mgtutor.build import this_build

    build = build or this_build()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GpuInfo(i, props.name, int(props.total_memory), (props.major, props.minor)))
    return HardwareInfo(
        cpu_cores=usable_cores(),
        memory_bytes=int(psutil.virtual_memory().total),
        gpus=tuple(gpus),
        torch_version=build.torch,
        cuda_build=build.cuda,
        gloo_available=dist.is_available() and dist.is_gloo_available(),
        nccl_available=build.nccl,
        platform=f"{build.os} {build.machine}, Python {'.'.join(map(str, build.python))}",
        accelerator=build.accelerator,
    )
