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

import atexit
import functools
import multiprocessing
import os
import platform
import re
import signal
import sys
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FORK_SAFE_PYTHON",
    "Build",
    "StartMethod",
    "loader_context",
    "loader_start_method",
    "needs_torchvision",
    "rank_start_method",
    "stop_loader_server",
    "this_build",
    "torch_release",
    "torchvision_for",
]

#: PyTorch's own package index; a local version such as ``+cpu`` names a folder of it.
PYTORCH_INDEX = "https://download.pytorch.org/whl"

#: For each Python 3.x, the first patch release whose forked child cannot hang on the runtime's
#: thread-list lock held by another thread at the fork (CPython gh-112275, fixed in 3.12 and in
#: 3.10.15 and 3.11.10, released 2024-09-07; see :func:`loader_start_method`). Earlier minor
#: versions are out of scope (mgtutor needs 3.10); later ones have the fix.
FORK_SAFE_PYTHON = {10: (3, 10, 15), 11: (3, 11, 10), 12: (3, 12, 0)}

#: How mgtutor can start rank processes: no "fork" (see :func:`rank_start_method`).
StartMethod = Literal["forkserver", "spawn"]


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
        xccl: whether ``torch.distributed`` has Intel's XCCL.
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

        ``DistributedDataParallel._check_comm_hook`` (``torch/nn/parallel/distributed.py``, read
        in torch 2.14.1) refuses a hook named ``bf16_compress_hook`` with a
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
        """Whether this system lets a process that imported torch fork (a forkserver's ranks).

        Not on macOS, whose system libraries are not safe to use in a forked child of a process
        with threads (Python made spawn macOS's default start method in 3.8, bpo-33725);
        Windows has no fork at all. DataLoader workers fork only where the Python is safe too
        (:attr:`loader_start_method`).
        """
        return _fork_safe(self.os, self.start_methods)

    @property
    def rank_start_method(self) -> StartMethod:
        """How mgtutor starts ranks by default here: "forkserver" where forking is safe, else
        "spawn" (see :func:`rank_start_method`)."""
        return _rank_start_method(self.os, self.start_methods)

    @property
    def loader_start_method(self) -> str:
        """How the notebooks start DataLoader workers here (see :func:`loader_start_method`).

        A worker that is not forked imports what it runs by name, so it must live in a module
        file (such as :mod:`mgtutor.data`): a class defined in a notebook cell cannot be found.
        """
        return _loader_start_method(self.os, self.python, self.start_methods)

    @property
    def loader_pins_memory(self) -> bool:
        """Whether ``DataLoader(pin_memory=True)`` hands out pinned batches on this machine.

        The DataLoader pins only with an accelerator, and turns pinning off again, with a
        warning, when that accelerator is MPS (``_BaseDataLoaderIter.__init__`` in
        ``torch/utils/data/dataloader.py``, read in torch 2.14.1). Without an accelerator it warns
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


def _loader_start_method(os: str, python: tuple[int, ...], start_methods: tuple[str, ...]) -> str:
    if not _fork_safe(os, start_methods):
        return "spawn"
    if _has_fork_fix(tuple(python)):
        return "fork"
    return "forkserver" if "forkserver" in start_methods else "spawn"


def _has_fork_fix(python: tuple[int, ...]) -> bool:
    first = FORK_SAFE_PYTHON.get(python[1], FORK_SAFE_PYTHON[12] if python[1] > 12 else None)
    return first is not None and python[:3] >= first


def _python_version() -> tuple[int, int, int]:
    major, minor, micro = sys.version_info[:3]
    return major, minor, micro


def _rank_start_method(os: str, start_methods: tuple[str, ...]) -> StartMethod:
    forkserver = _fork_safe(os, start_methods) and "forkserver" in start_methods
    return "forkserver" if forkserver else "spawn"


def rank_start_method() -> StartMethod:
    """How mgtutor starts ranks by default: "forkserver" on Linux, "spawn" on macOS.

    mgtutor's forkserver imports torch once and forks every rank from it. On macOS a fork child
    of a process that ever had a second thread aborts when it first initialises an Objective-C
    class (objc4's ``performForkChildInitialize``, ``runtime/objc-initialize.mm``), and
    importing torch starts threads (numpy's OpenBLAS pool; notebook 00 counts them), so there
    every rank is spawned. Read without importing torch.
    """
    return _rank_start_method(platform.system(), tuple(multiprocessing.get_all_start_methods()))


def loader_start_method() -> str:
    """How DataLoader workers start here: "fork", "forkserver" or "spawn". Imports no torch.

    * "fork" on Linux with Python 3.10.15, 3.11.10, 3.12 or later: a forked worker starts at
      once, with the dataset already in its memory.
    * "forkserver" on Linux with Python 3.10.0-3.10.14 and 3.11.0-3.11.9, where a forked child
      can hang for good on the thread-list lock another thread held at the fork (CPython
      gh-112275, :data:`FORK_SAFE_PYTHON`); a rank has other threads, and its forked workers
      hung about 1 run in 5 here (3.10.13). A forkserver has no other threads
      (:func:`loader_context`).
    * "spawn" on macOS, whose system libraries are unsafe in a forked child of a process with
      threads (Python made spawn macOS's default in 3.8, bpo-33725), and on Windows.
    """
    methods = tuple(multiprocessing.get_all_start_methods())
    return _loader_start_method(platform.system(), _python_version(), methods)


def loader_context(*preload: str) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing_context`` for DataLoader workers here (:func:`loader_start_method`).

    A forkserver imports ``preload`` (and torch) once, so that the workers it forks need not:
    on a busy 2-core machine importing torch takes seconds. That is set here only in a process
    that multiprocessing started (a rank), which starts a forkserver of its own for its loaders,
    kept for its later loaders and stopped when it exits (:func:`stop_loader_server`). The
    notebook's own process shares mgtutor's rank server, which imports torch already (mgtutor
    starts it in a kernel on Linux), and whose imports are not changed here.

    Args:
        preload: modules the workers need, such as the one defining the dataset's class.
    """
    method = loader_start_method()
    context = multiprocessing.get_context(method)
    if method == "forkserver" and multiprocessing.parent_process() is not None:
        context.set_forkserver_preload(["torch", *preload])
        _stop_at_exit()
    return context


@functools.cache
def _stop_at_exit() -> None:
    atexit.register(stop_loader_server)


def stop_loader_server() -> None:
    """In a rank: stop the forkserver that its loaders started (:func:`loader_context`).

    It would end by itself a moment after the rank, but mgtutor's launcher reports the processes
    a rank leaves behind, so :func:`loader_context` has a rank call this as it exits. SIGTERM
    ends the server at once (it has no handler); ``_stop`` then reaps it, as multiprocessing's
    own tests stop a forkserver. Nothing happens in the notebook's process, whose forkserver is
    mgtutor's rank server, nor where none was started.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if multiprocessing.parent_process() is None or pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass  # ended already; _stop reaps it
    server._stop()


def torch_release(version: str | None = None) -> tuple[int, int]:
    """torch's (major, minor) release, for version gates: ``torch_release() >= (2, 13)``.

    A nightly or source build of 2.13 calls itself "2.13.0a0+git..." and has 2.13's code, but
    ``torch.__version__ >= (2, 13)`` is False for it (a pre-release sorts before the release), so
    such a gate would send it down the older path.
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
        >>> build.loader_start_method in ("fork", "forkserver", "spawn")
        True
    """
    import torch
    import torch.distributed as dist

    has_dist = dist.is_available()
    nccl = has_dist and dist.is_nccl_available()
    nccl_version = tuple(torch.cuda.nccl.version()) if nccl else None
    xccl = has_dist and getattr(dist, "is_xccl_available", lambda: False)()  # torch 2.8 on
    vision, vision_error = _torchvision()
    return Build(
        os=platform.system(),
        machine=platform.machine(),
        python=_python_version(),
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
