"""What this build of torch, on this machine, offers: read once, in one place.

A learner runs the workbook on a torch of their own: a CUDA build on Linux, a CPU-only wheel
(no CUDA, no NCCL), macOS with Apple's MPS, with or without torchvision. Where torch behaves
differently on them, a notebook branches on :func:`this_build`, so every platform branch is
named here and a test can stand in for any platform (``tests/test_build.py``).

The facts are torch's own answers (``torch.version.cuda``, ``torch.distributed.is_nccl_available``,
``torch.accelerator``); the properties derive what the notebooks need from the same facts torch
checks, each citing where torch checks it.
"""

from __future__ import annotations

import functools
import multiprocessing
import platform
import re
import sys
from dataclasses import dataclass

__all__ = [
    "Build",
    "loader_start_method",
    "needs_torchvision",
    "rank_start_method",
    "this_build",
    "torch_release",
    "torchvision_for",
]

#: PyTorch's own package index; a local version such as ``+cpu`` names a folder of it.
PYTORCH_INDEX = "https://download.pytorch.org/whl"


@dataclass(frozen=True)
class Build:
    """The platform facts the notebooks branch on.

    Attributes:
        os: ``platform.system()``: "Linux", "Darwin" (macOS) or "Windows".
        machine: ``platform.machine()``: "x86_64", "arm64" (Apple silicon), ...
        python: Python's (major, minor, micro).
        torch: ``torch.__version__``, its local version included ("2.13.0+cpu").
        cuda: the CUDA version torch was compiled with, None for a build without CUDA.
        hip: the ROCm (HIP) version torch was compiled with, or None.
        nccl: whether ``torch.distributed`` has NCCL (False on CPU-only wheels and macOS).
        nccl_version: NCCL's version where it has it, e.g. (2, 30, 7).
        xccl: whether ``torch.distributed`` has Intel's XCCL (torch 2.8 and later).
        accelerator: the device type of the accelerator torch can use now ("cuda", "mps",
            "xpu"), None without one (a CUDA build on a machine without a GPU included).
        torchvision: torchvision's version where it imports, else None.
        torchvision_error: why it does not import ("No module named 'torchvision'", or the error
            a torchvision built for another torch raises), None where it does.
        start_methods: what ``multiprocessing`` offers here ("fork" is absent on Windows).
    """

    os: str
    machine: str
    python: tuple[int, int, int]
    torch: str
    cuda: str | None
    hip: str | None
    nccl: bool
    nccl_version: tuple[int, ...] | None
    xccl: bool
    accelerator: str | None
    torchvision: str | None
    torchvision_error: str | None
    start_methods: tuple[str, ...]

    @property
    def bf16_compress_hook_accepted(self) -> bool:
        """Whether DDP accepts torch's ``bf16_compress_hook`` on this build.

        ``DistributedDataParallel._check_comm_hook`` (torch 2.11 to 2.15,
        ``torch/nn/parallel/distributed.py``) refuses a hook named ``bf16_compress_hook`` with a
        TypeError unless torch has CUDA (or ROCm) and NCCL 2.10 or later, or XCCL and an XPU.
        It asks nothing of the GPUs themselves: a CUDA build on a machine without one accepts
        it, and the hook then runs over gloo. ``fp16_compress_hook`` has no such check.
        """
        with_nccl = (
            (self.cuda is not None or self.hip is not None)
            and self.nccl
            and (self.nccl_version or (0,)) >= (2, 10)
        )
        return with_nccl or (self.xccl and self.accelerator == "xpu")

    @property
    def fork_safe(self) -> bool:
        """Whether a process that has imported torch may fork workers (DataLoader's, or ranks).

        Not on macOS, whose system libraries are not safe to use in a forked child of a process
        with threads (Python made spawn macOS's default start method in 3.8, bpo-33725);
        Windows has no fork at all.
        """
        return _fork_safe(self.os, self.start_methods)

    @property
    def rank_start_method(self) -> str:
        """How mgtutor starts ranks by default here: "forkserver" where forking is safe, else
        "spawn" (see :func:`rank_start_method`)."""
        return _rank_start_method(self.os, self.start_methods)

    @property
    def loader_start_method(self) -> str:
        """How the notebooks start DataLoader workers: "fork" where it is safe, else "spawn".

        A spawned worker imports what it runs by name, so it must live in a module file (such as
        :mod:`mgtutor.data`): a class defined in a notebook cell cannot be found there.
        """
        return "fork" if self.fork_safe else "spawn"

    @property
    def loader_pins_memory(self) -> bool:
        """Whether ``DataLoader(pin_memory=True)`` hands out pinned batches on this machine.

        The DataLoader pins only with an accelerator, and turns pinning off again, with a
        warning, when that accelerator is MPS (``_BaseDataLoaderIter.__init__`` in
        ``torch/utils/data/dataloader.py``, torch 2.11 to 2.15). Without an accelerator it warns
        too; with CUDA or XPU it pins silently.
        """
        return self.accelerator is not None and self.accelerator != "mps"

    @property
    def torchvision_install(self) -> str:
        """The command that installs the torchvision made for this torch."""
        return torchvision_for(self.torch)

    def describe(self) -> str:
        """One line: which build this is, for the cells that say which path they took."""
        cuda = f"CUDA {self.cuda}" if self.cuda else "no CUDA"
        nccl = "NCCL" if self.nccl else "no NCCL"
        python = ".".join(map(str, self.python))
        return (
            f"torch {self.torch} ({cuda}, {nccl}, accelerator: {self.accelerator or 'none'}) "
            f"on {self.os} {self.machine}, Python {python}"
        )


def _fork_safe(os: str, start_methods: tuple[str, ...]) -> bool:
    return "fork" in start_methods and os != "Darwin"


def _rank_start_method(os: str, start_methods: tuple[str, ...]) -> str:
    forkserver = _fork_safe(os, start_methods) and "forkserver" in start_methods
    return "forkserver" if forkserver else "spawn"


def rank_start_method() -> str:
    """How mgtutor starts ranks by default: "forkserver" on Linux, "spawn" on macOS.

    mgtutor's forkserver imports torch once and forks every rank from it. On macOS a fork
    child aborts when it initialises an Objective-C class if its parent ever had a second
    thread (objc4's fork-safety check, ``objc-initialize.mm``; ``pthread_is_threaded_np`` stays
    true once a thread existed), and importing torch can start one (numpy's OpenBLAS pool, on
    the numpy wheels for macOS before 14) while loading Foundation and Metal: the abort
    Lightning's fork-based DDP met on macOS (Lightning-AI/pytorch-lightning#21345). A spawned
    rank is a fresh interpreter that forks from nothing. Read without importing torch.
    """
    return _rank_start_method(platform.system(), tuple(multiprocessing.get_all_start_methods()))


def loader_start_method() -> str:
    """:attr:`Build.loader_start_method` without reading the rest (no torch, no torchvision).

    For code in a rank, which starts DataLoader workers the notebooks' way.
    """
    methods = tuple(multiprocessing.get_all_start_methods())
    return "fork" if _fork_safe(platform.system(), methods) else "spawn"


def torch_release(version: str | None = None) -> tuple[int, int]:
    """torch's (major, minor) release, for version gates: ``torch_release() >= (2, 13)``.

    A nightly or source build of 2.13 calls itself "2.13.0a0+git..." and has 2.13's code, but
    ``torch.__version__ >= (2, 13)`` is False for it (a pre-release sorts before the release), so
    such a gate would send it down the older path.

    Example:
        >>> torch_release("2.13.0a0+git1234")
        (2, 13)
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read a torch release from {version!r}")
    return int(found[1]), int(found[2])


def torchvision_for(torch_version: str) -> str:
    """The pip command for the torchvision that pairs with ``torch_version``.

    torch 2.N.P pairs with torchvision 0.(N+15).P (2.14.1 with 0.29.1). A local version such as
    ``+cpu`` means the wheel came from PyTorch's own index, whose folder of that name has the
    matching torchvision; PyPI's is built for PyPI's torch and does not import beside a ``+cpu``
    wheel.

    Example:
        >>> torchvision_for("2.13.0+cpu")
        'pip install torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu'
    """
    found = re.match(r"2\.(\d+)\.(\d+)", torch_version)
    if found is None:
        return "pip install torchvision  # pick the release made for your torch"
    release, local = torch_version.partition("+")[::2]
    command = f"pip install torchvision==0.{int(found[1]) + 15}.{found[2]}"
    if "a" in release.split(".")[-1] or "dev" in release:  # a nightly: no release pairs with it
        return f"pip install --pre torchvision --index-url {PYTORCH_INDEX}/nightly/{local or 'cpu'}"
    return f"{command} --index-url {PYTORCH_INDEX}/{local}" if local else command


def _accelerator(torch: object) -> str | None:
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6 and later
    if accelerator is not None:
        if not accelerator.is_available():
            return None
        current = accelerator.current_accelerator()
        return None if current is None else current.type
    if torch.cuda.is_available():  # type: ignore[attr-defined]
        return "cuda"
    mps = getattr(torch.backends, "mps", None)  # type: ignore[attr-defined]
    return "mps" if mps is not None and mps.is_available() else None


def _torchvision() -> tuple[str | None, str | None]:
    try:
        import torchvision
    except Exception as exc:  # absent, or built for another torch (its operators fail to load)
        return None, f"{type(exc).__name__}: {exc}"
    return torchvision.__version__, None


@functools.cache
def this_build() -> Build:
    """Read this build's facts once (importing torch and, to see that it imports, torchvision).

    Example:
        >>> build = this_build()
        >>> build.loader_start_method in ("fork", "spawn")
        True
    """
    import torch
    import torch.distributed as dist

    has_dist = dist.is_available()
    nccl = has_dist and dist.is_nccl_available()
    nccl_version = tuple(torch.cuda.nccl.version()) if nccl else None
    xccl = has_dist and getattr(dist, "is_xccl_available", lambda: False)()
    vision, vision_error = _torchvision()
    return Build(
        os=platform.system(),
        machine=platform.machine(),
        python=tuple(sys.version_info[:3]),  # type: ignore[arg-type]
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=getattr(torch.version, "hip", None),
        nccl=nccl,
        nccl_version=nccl_version,
        xccl=xccl,
        accelerator=_accelerator(torch),
        torchvision=vision,
        torchvision_error=vision_error,
        start_methods=tuple(multiprocessing.get_all_start_methods()),
    )


def needs_torchvision(what: str, build: Build | None = None) -> bool:
    """Whether torchvision imports here; where not, print that ``what`` is SKIPPED, and the fix.

    Args:
        what: the cell's work, for the message ("converting ResNet-18").
        build: the build's facts; :func:`this_build` by default.

    Example:
        >>> if needs_torchvision("counting ResNet-50's layers"):  # doctest: +SKIP
        ...     import torchvision
    """
    build = build or this_build()
    if build.torchvision is not None:
        return True
    print(
        f"SKIPPED: {what} needs torchvision, which does not import here "
        f"({build.torchvision_error}). For torch {build.torch}: {build.torchvision_install}"
    )
    return False
