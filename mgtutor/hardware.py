"""What this machine offers a data-parallel job: cores, memory, GPUs and backends.

Notebook 00 starts here: :func:`describe_hardware` says which GPUs CUDA sees and which backend
:func:`mgtutor.setup` will pick for each world size, so a learner knows which path of each
notebook will run (the real GPU one, or the CPU one with gloo).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

__all__ = ["GpuInfo", "HardwareInfo", "describe_hardware"]


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
    """

    cpu_cores: int
    memory_bytes: int
    gpus: tuple[GpuInfo, ...]
    torch_version: str
    cuda_build: str | None
    gloo_available: bool
    nccl_available: bool
    platform: str

    def backend_for(self, world_size: int) -> str:
        """The backend :func:`mgtutor.setup` picks for ``world_size`` ranks on this machine."""
        return choose_backend(len(self.gpus), self.nccl_available, world_size)

    def device_for(self, world_size: int) -> str:
        """Where each rank computes by default for ``world_size`` ranks on this machine."""
        return "cuda:LOCAL_RANK" if self.backend_for(world_size) == "nccl" else "cpu"

    def _lines(self) -> list[str]:
        from mgtutor.measure.memory import format_bytes

        lines = [
            f"platform     {self.platform}",
            f"torch        {self.torch_version} (CUDA build: {self.cuda_build or 'none'})",
            f"CPU cores    {self.cpu_cores}",
            f"memory       {format_bytes(self.memory_bytes)}",
            f"backends     gloo: {'yes' if self.gloo_available else 'no'}, "
            f"nccl: {'yes' if self.nccl_available else 'no'}",
        ]
        if self.gpus:
            for g in self.gpus:
                lines.append(
                    f"GPU {g.index}        {g.name}, {format_bytes(g.total_memory)}, "
                    f"compute capability {g.capability[0]}.{g.capability[1]}"
                )
        else:
            lines.append("GPUs         none visible to CUDA: every rank will be a CPU process")
        return lines

    def __repr__(self) -> str:
        return "\n".join(self._lines())


def choose_backend(gpus: int, nccl_available: bool, local_ranks: int) -> str:
    """The one rule for the default backend: NCCL with a GPU per local rank, else gloo.

    NCCL refuses two ranks on one GPU, so fewer GPUs than ranks on a machine means gloo.
    :func:`mgtutor.backend_for` (live, in a rank) and :meth:`HardwareInfo.backend_for` (from a
    description) both answer with it.
    """
    return "nccl" if nccl_available and gpus >= local_ranks else "gloo"


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask, or every core on macOS.

    A container, ``taskset`` or a batch scheduler can allow fewer cores than the machine has;
    ``os.cpu_count()`` would count them all.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def describe_hardware() -> HardwareInfo:
    """Look at this machine without starting any worker.

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

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GpuInfo(i, props.name, int(props.total_memory), (props.major, props.minor)))
    available = dist.is_available()
    return HardwareInfo(
        cpu_cores=usable_cores(),
        memory_bytes=int(psutil.virtual_memory().total),
        gpus=tuple(gpus),
        torch_version=torch.__version__,
        cuda_build=torch.version.cuda,
        gloo_available=available and dist.is_gloo_available(),
        nccl_available=available and dist.is_nccl_available(),
        platform=f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    )
