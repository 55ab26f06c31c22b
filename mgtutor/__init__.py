"""mgtutor: run data-parallel PyTorch workers from a notebook cell and see what they do.

The workbook's helper package. Its modules, in the order the notebooks meet them:

* :mod:`mgtutor.launch`: :func:`launch` starts one process per rank from a cell.
* :mod:`mgtutor.pool`: :class:`Pool`, ranks kept alive between cells; :mod:`mgtutor.magic`,
  the ``%%ddp`` cell magic on top of it (``%load_ext mgtutor``).
* :mod:`mgtutor.worker`: :func:`setup` joins the process group inside a worker (also under
  torchrun and SLURM).
* :mod:`mgtutor.run`: :class:`Run`, what a launch returns.
* :mod:`mgtutor.errors`: :class:`WorkerError` and :class:`WorkerTimeout`.
* :mod:`mgtutor.progress`: :func:`progress`, per-rank progress bars.
* :mod:`mgtutor.timing`: :func:`phase`, :func:`step`, :class:`StepTimer`.
* :mod:`mgtutor.memory`: what the per-rank memory figures count.
* :mod:`mgtutor.memplan`: :func:`~mgtutor.memplan.breakdown`, :func:`~mgtutor.memplan.estimate`
  and :func:`plot_breakdown`, each rank's memory by category (parameters, gradients,
  optimizer state, DDP buckets), measured and computed; :func:`track` puts it in the run.
* :mod:`mgtutor.activations`: :class:`~mgtutor.activations.LiveTensors`, the bytes a forward
  and backward create and keep alive, measured on any device (activations on CPU ranks).
* :mod:`mgtutor.plots`: :func:`plot_memory`, :func:`plot_timeline`, :func:`plot_step_times`,
  :func:`plot_scaling`.
* :mod:`mgtutor.hardware`: :func:`describe_hardware`, what this machine offers.
* :mod:`mgtutor.interactive`: :class:`Experiment`, controls and a Run button that re-run an
  experiment and redraw its plot.
* :mod:`mgtutor.syncbn`: :class:`SyncBatchNorm` that also runs on CPU ranks, and
  :func:`convert_sync_batchnorm`.
* :mod:`mgtutor.bench`: the all-reduce bandwidth benchmark (``python -m mgtutor.bench``).
* :mod:`mgtutor.checkpoint`: :func:`save_checkpoint` that never leaves a half-written file.
* :mod:`mgtutor.data`: an offline dataset that learns, and CIFAR-10 where available.
* :mod:`mgtutor.models`: :func:`~mgtutor.models.small_cnn` and :func:`~mgtutor.models.mlp`, the
  workbook's models.
* :mod:`mgtutor.stats`: :func:`~mgtutor.stats.spread` and :func:`~mgtutor.stats.compare`,
  repeated measurements read with their spread.
* :mod:`mgtutor.metrics`: :func:`reduce_mean` and :func:`reduce_sums`, figures over all ranks.
* :mod:`mgtutor.doctor`: what the ranks' records of their collectives (torch's Flight
  Recorder) say went wrong in a hang; :func:`~mgtutor.doctor.find_drift`, replicas that differ.
* :mod:`mgtutor.exercises`: exercises that check themselves on CPU ranks.

Importing mgtutor does not import torch or matplotlib: every worker imports this package
first, and a worker's start-up time is the floor of every launch.
"""

import os
import sys

from mgtutor.checkpoint import load_checkpoint, save_checkpoint
from mgtutor.errors import WorkerError, WorkerTimeout
from mgtutor.hardware import HardwareInfo, describe_hardware
from mgtutor.interactive import Experiment
from mgtutor.launch import launch
from mgtutor.memory import MemoryStats
from mgtutor.memplan import MemoryBreakdown, plot_breakdown, track
from mgtutor.plots import plot_memory, plot_scaling, plot_step_times, plot_timeline
from mgtutor.pool import Pool
from mgtutor.progress import progress
from mgtutor.run import RankResult, Run
from mgtutor.timing import PhaseRecord, StepTimer, phase, step, timer
from mgtutor.worker import backend_for, get_contract, setup, teardown

__all__ = [
    "Experiment",
    "HardwareInfo",
    "SyncBatchNorm",
    "MemoryBreakdown",
    "MemoryStats",
    "PhaseRecord",
    "Pool",
    "RankResult",
    "Run",
    "StepTimer",
    "WorkerError",
    "WorkerTimeout",
    "backend_for",
    "convert_sync_batchnorm",
    "describe_hardware",
    "get_contract",
    "launch",
    "load_checkpoint",
    "phase",
    "plot_breakdown",
    "plot_memory",
    "plot_scaling",
    "plot_step_times",
    "plot_timeline",
    "progress",
    "reduce_mean",
    "reduce_sums",
    "save_checkpoint",
    "setup",
    "step",
    "teardown",
    "timer",
    "track",
]


# Submodules that import torch when loaded, reachable as ``mgtutor.data`` and so on after a
# plain ``import mgtutor``: loaded on first use, since every worker imports this package first.
_LAZY_MODULES = (
    "activations",
    "bench",
    "data",
    "exercises",
    "metrics",
    "models",
    "stats",
    "syncbn",
)
# Public names that live in those submodules, and the submodule each one is loaded from.
_LAZY_NAMES = {
    "SyncBatchNorm": "syncbn",
    "convert_sync_batchnorm": "syncbn",
    "reduce_mean": "metrics",
    "reduce_sums": "metrics",
}


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f"mgtutor.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"mgtutor.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module 'mgtutor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULES) | set(_LAZY_NAMES))


def _start_server_in_a_kernel() -> None:
    # In a Jupyter kernel a launch nearly always follows: start the ranks' forkserver now, so
    # that its imports overlap with the notebook's first cells (see _processes.start_server_early).
    # Not in scripts, not in ranks, and never at the cost of the import itself.
    import multiprocessing

    if "ipykernel" not in sys.modules or multiprocessing.current_process().name != "MainProcess":
        return
    if os.environ.get("MGTUTOR_EARLY_SERVER", "1") == "0":
        return
    try:
        from mgtutor import _processes

        _processes.start_server_early()
    except Exception:  # an optimisation only: the first launch starts the server otherwise
        pass


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext mgtutor``: add the ``%%ddp`` cell magic (see :mod:`mgtutor.magic`)."""
    from mgtutor.magic import load_ipython_extension as load

    load(ipython)


_start_server_in_a_kernel()
