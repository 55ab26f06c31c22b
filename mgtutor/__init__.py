"""mgtutor: run data-parallel PyTorch workers from a notebook cell and see what they do.

The workbook's helper package. Its folders and modules stand in layers, each importing only
from the layers below it (``tests/test_layout.py`` checks it), top first:

* :mod:`mgtutor.bench` (the all-reduce bandwidth benchmark, ``python -m mgtutor.bench``), then
  this module, the public names.
* :mod:`mgtutor.interactive`: :class:`Experiment`, controls that re-run an experiment.
* :mod:`mgtutor.exercises`: exercises that check themselves on CPU ranks, one module per
  exercise named by its key (its public ``check_*`` function, cases and diagnosis); reference
  solutions in :mod:`~.exercises.solutions`.
* :mod:`mgtutor.launcher`: starting ranks from a cell and looking after them.
  :func:`launch` runs a function once on every rank; :class:`Pool` keeps ranks alive between
  cells; :mod:`~mgtutor.launcher.magic` is the ``%%ddp`` cell magic (``%load_ext mgtutor``);
  :class:`Run` is what a launch returns. Its underscored modules are the machinery: checking
  arguments, starting processes, relaying output, supervision and clean-up.
* :mod:`mgtutor.rank`: what runs inside a rank: its loop, the names a call sees, and
  :func:`progress` (a rank's count, drawn as a bar per rank).
* :mod:`mgtutor.doctor`: what the ranks' records of their collectives (torch's Flight
  Recorder) say went wrong in a hang; :func:`~mgtutor.doctor.find_drift`, replicas that differ.
* :mod:`mgtutor.experiments`: a layout or a step run on ranks, set beside what was predicted:
  :mod:`~.experiments.traffic` (each step's collectives counted in the ranks, and torch's own,
  against the planner's) and :mod:`~.experiments.step_check` (the step-time model against this
  machine's CPU ranks).
* :mod:`mgtutor.measure`: what a rank measures and how it is shown: :mod:`~.measure.timing`
  (:func:`phase`, :func:`step`, :class:`StepTimer`), :mod:`~.measure.trace` (torch's profiler
  in each rank, DDP's own all-reduces among its events: :func:`record_trace`, one file for all
  ranks: :func:`write_trace`), :mod:`~.measure.memory` (what the
  per-rank memory figures count), :mod:`~.measure.breakdown` (each rank's memory by category),
  :mod:`~.measure.activations` (the bytes a forward and backward keep alive),
  :mod:`~.measure.stats` (repeated measurements read with their spread) and
  :mod:`~.measure.plots`.
* :mod:`mgtutor.parallel`: what the notebooks build by hand: :mod:`~.parallel.syncbn`
  (:class:`SyncBatchNorm` that also runs on CPU ranks), tensor and sequence parallelism
  (:mod:`~.parallel.tensor`, :mod:`~.parallel.tensor_comms`; :mod:`~.parallel.gpt_layer`, a
  layer that keeps for backward what Korthikanti et al. count), ring attention
  (:mod:`~.parallel.context`), pipeline stages (:mod:`~.parallel.pipeline`) and experts
  (:mod:`~.parallel.expert`). Beside it, :mod:`mgtutor.plan`: what is predicted, from formulas:
  :mod:`~.plan.memplan` (each rank's memory by category, computed ahead), :mod:`~.plan.planner`
  (a transformer's memory and traffic per GPU for a layout; its activations term by term in
  :mod:`~.plan.activation_plan`) and :mod:`~.plan.step_time` (a layout's predicted step time,
  checked against CPU ranks by :mod:`~.experiments.step_check`).
* :mod:`mgtutor.worker`: :func:`setup` joins the process group inside a worker (also under
  torchrun and SLURM); :func:`teardown` leaves it.
* The ground: :mod:`mgtutor.errors` (:class:`WorkerError`, :class:`WorkerTimeout`,
  :class:`WorkerInterrupted`, :class:`ArgumentError`), :mod:`mgtutor.hardware`
  (:func:`describe_hardware`), :mod:`mgtutor.data` (an offline dataset that learns, CIFAR-10
  where available), :mod:`mgtutor.models`, :mod:`mgtutor.metrics` (:func:`reduce_mean`,
  :func:`reduce_sums`), :mod:`mgtutor.checkpoint` (:func:`save_checkpoint` never leaves a
  half-written file); under them :mod:`mgtutor.build` (:func:`~.build.this_build`: the OS,
  Python, torch, CUDA, NCCL, accelerator and torchvision of this build, which every platform
  branch of the notebooks reads), :mod:`mgtutor.units` (:func:`~.units.format_bytes`) and
  :mod:`mgtutor.ring` (:func:`~.ring.bytes_sent_on_ring`, the bytes one rank sends in a ring
  collective) and :mod:`mgtutor.wire` (the messages between notebook and ranks, and pickling
  both ways: what launcher and rank both speak), which import nothing of mgtutor.

Importing mgtutor does not import torch or matplotlib: every worker imports this package
first, and a worker's start-up time is the floor of every launch.
"""

import os
import sys

from mgtutor.checkpoint import load_checkpoint, save_checkpoint
from mgtutor.errors import ArgumentError, PoolClosed, WorkerError, WorkerInterrupted, WorkerTimeout
from mgtutor.hardware import HardwareInfo, describe_hardware
from mgtutor.interactive import Experiment
from mgtutor.launcher.launch import launch
from mgtutor.launcher.lifetime import shutdown
from mgtutor.launcher.pool import Pool
from mgtutor.launcher.run import RankResult, Run
from mgtutor.measure.breakdown import track
from mgtutor.measure.memory import MemoryStats
from mgtutor.measure.plots import (
    plot_breakdown,
    plot_memory,
    plot_scaling,
    plot_step_times,
    plot_timeline,
)
from mgtutor.measure.timing import PhaseRecord, StepTimer, phase, step, timer
from mgtutor.measure.trace import record_trace, write_trace
from mgtutor.plan.memplan import MemoryBreakdown
from mgtutor.rank.progress import progress
from mgtutor.worker import backend_for, get_contract, setup, teardown

__all__ = [
    "ArgumentError",
    "Experiment",
    "HardwareInfo",
    "SyncBatchNorm",
    "MemoryBreakdown",
    "MemoryStats",
    "PhaseRecord",
    "Pool",
    "PoolClosed",
    "RankResult",
    "Run",
    "StepTimer",
    "WorkerError",
    "WorkerInterrupted",
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
    "record_trace",
    "reduce_mean",
    "reduce_sums",
    "save_checkpoint",
    "setup",
    "shutdown",
    "step",
    "teardown",
    "timer",
    "track",
    "write_trace",
]


# Submodules that import torch when loaded, reachable as ``mgtutor.data`` and so on after a
# plain ``import mgtutor``: loaded on first use, since every worker imports this package first.
_LAZY_MODULES = (
    "bench",
    "data",
    "exercises",
    "metrics",
    "models",
    "parallel",
)
# Public names that live in those submodules, and the submodule each one is loaded from.
_LAZY_NAMES = {
    "SyncBatchNorm": "parallel.syncbn",
    "convert_sync_batchnorm": "parallel.syncbn",
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
    # that its imports overlap with the notebook's first cells (see launcher.start_server_early).
    # Not in scripts, not in ranks, and never at the cost of the import itself.
    import multiprocessing

    if "ipykernel" not in sys.modules or multiprocessing.current_process().name != "MainProcess":
        return
    if os.environ.get("MGTUTOR_EARLY_SERVER", "1") == "0":
        return
    try:
        from mgtutor.launcher import start_server_early

        start_server_early()  # not on macOS, where ranks are spawned
    except Exception:  # an optimisation only: the first launch starts the server otherwise
        pass


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext mgtutor``: add the ``%%ddp`` cell magic (see :mod:`mgtutor.launcher.magic`)."""
    from mgtutor.launcher.magic import load_ipython_extension as load

    load(ipython)


_start_server_in_a_kernel()
