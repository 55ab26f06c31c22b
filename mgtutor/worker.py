"""What a training function calls inside a rank: the environment contract, ``setup()``, teardown.

A worker learns who it is from environment variables, the contract torchrun defines:
``RANK`` (its index among all workers), ``LOCAL_RANK`` (its index on this machine),
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (where the rendezvous
store listens). :func:`mgtutor.launch` sets them for each worker it starts; torchrun sets them
too; under SLURM's ``srun``, :func:`setup` reads ``SLURM_PROCID``, ``SLURM_LOCALID`` and
``SLURM_NTASKS`` instead. So one training function runs unchanged in all three.

This module must stay cheap to import: every rank imports it before anything else, so torch is
imported only inside the functions that need it. How a rank process itself starts and runs the
notebook's calls is in :mod:`mgtutor.rank.loop`.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from mgtutor.hardware import RankPlace, agree_on_backend

if TYPE_CHECKING:
    import torch

__all__ = ["backend_for", "get_contract", "setup", "share_cores", "teardown", "WorkerContract"]

BACKENDS = ("gloo", "nccl")

_state: dict[str, Any] = {"device": None, "backend": None}

# torch's switch for a store-based barrier at the end of init_process_group and new_group
# (read in torch.distributed.distributed_c10d, default "0"). Without it, a gloo rank counts a
# connection as made once it has written its handshake into the peer's socket, so a rank whose
# function returns at once can exit, closing that socket, while its peer is still connecting:
# the peer then fails in connectFullMesh with "Connection closed by peer". Common on a busy
# machine, where the peer is slow to be scheduled. With the barrier, no rank leaves
# init_process_group (or new_group) before every rank has finished connecting.
INIT_BARRIER_ENV = "TORCH_DIST_INIT_BARRIER"


@dataclass(frozen=True)
class WorkerContract:
    """Who this worker is, as read from its environment.

    Attributes:
        rank: index of this worker among all workers (0 .. world_size-1).
        local_rank: index of this worker on its own machine; picks its GPU.
        world_size: number of workers in the job.
        local_world_size: number of workers on this machine.
        master_addr: host of the rendezvous store.
        master_port: port of the rendezvous store.
        source: which launcher's variables were read: "torchrun" (also mgtutor.launch) or "slurm".
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a whole number") from None


def _slurm_tasks_on_this_node() -> int | None:
    # SLURM writes e.g. "4" or "2(x3)" (2 tasks on each of 3 nodes); the first number is ours
    # only when every node runs the same count, which is the usual --ntasks-per-node case.
    raw = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not raw:
        return None
    digits = raw.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else None


def get_contract() -> WorkerContract:
    """Read this worker's rank, world size and rendezvous address from the environment.

    Returns:
        The contract. torchrun's variables (which :func:`mgtutor.launch` also sets) win over
        SLURM's, because ``srun torchrun ...`` sets both and torchrun's are the per-worker ones.

    Raises:
        RuntimeError: when neither set of variables is present, or SLURM runs without
            ``MASTER_ADDR``, with what to set.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
        local_rank = _int_env("LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int_env("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        source = "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world_size = _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS")
        local_rank = _int_env("SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_world = _slurm_tasks_on_this_node() or world_size
        source = "slurm"
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                "Running under SLURM but MASTER_ADDR is not set. In your sbatch script add\n"
                "  export MASTER_ADDR="
                '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
                "so every task finds the rendezvous on the job's first node."
            )
        if "MASTER_PORT" not in env:
            # A port derived from the job id keeps two jobs sharing a node apart.
            job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
            env["MASTER_PORT"] = str(15000 + job_id % 20000)
    else:
        raise RuntimeError(
            "This process has no rank: RANK and WORLD_SIZE (or SLURM_PROCID and SLURM_NTASKS) "
            "are not set. Call mgtutor.setup() inside a function started by mgtutor.launch(), "
            "torchrun, or srun, not in the notebook itself."
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise RuntimeError(
                f"{name} is not set, so the workers cannot find each other. torchrun and "
                f"mgtutor.launch set it; when starting workers by hand, export {name} first."
            )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
    return WorkerContract(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world,
        master_addr=env["MASTER_ADDR"],
        master_port=_int_env("MASTER_PORT"),
        source=source,
    )


def backend_for(local_world_size: int) -> str:
    """Name the backend :func:`setup` picks when a machine runs this many workers.

    "nccl" when CUDA has at least one GPU per local worker (NCCL refuses two ranks on one GPU),
    "gloo" otherwise: ``backend_for(2)`` is 'gloo' on a laptop without CUDA.
    """
    import torch
    import torch.distributed as dist

    from mgtutor.hardware import choose_backend

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return choose_backend(gpus, dist.is_nccl_available(), local_world_size)


def _threads_per_rank(contract: WorkerContract) -> int:
    """How many CPU threads a rank gets: its share of the cores the ranks on this machine share.

    Under srun with ``--cpus-per-task``, Slurm binds each task to cores of its own, so the
    affinity mask is already this rank's share and is not divided again.
    """
    from mgtutor.hardware import usable_cores

    cores = usable_cores()
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if contract.source == "slurm" and per_task.isdigit() and cores <= int(per_task):
        return cores
    return max(1, cores // contract.local_world_size)


def share_cores() -> int:
    """Set this rank's torch threads (returned): ``OMP_NUM_THREADS`` where set, else its share.

    The launcher calls it in every rank before fn, so a plain ``init_process_group`` gets the
    share :func:`setup` gives (torchrun sets 1 for several workers). It applies the variable
    itself: a forkserver rank's torch was imported before the notebook may have set it.
    """
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        count = int(threads)
    else:
        count = _threads_per_rank(get_contract())
    torch.set_num_threads(count)
    return count


def setup(
    backend: str | None = None,
    *,
    device: str | None = None,
    timeout_s: float | None = None,
) -> torch.device:
    """Join the default process group and pick this rank's device.

    Call it first thing inside a worker. Calling it again is harmless and returns the same device.
    It returns once every rank has joined, so a rank may leave at once without breaking the join
    of a slower one (unless TORCH_DIST_INIT_BARRIER=0 is set; see ``INIT_BARRIER_ENV``).

    Args:
        backend: "nccl" or "gloo". By default the one :func:`mgtutor.launch` was asked for, else
            :func:`backend_for` the number of workers on this machine; in a job of several
            nodes, NCCL only if every rank has a GPU of its own on its machine, two nodes on one
            machine included (the ranks agree through the rendezvous store).
        device: "cuda" to put gloo ranks on GPUs too (ranks then share GPUs round-robin);
            by default gloo ranks use the CPU and NCCL ranks use ``cuda:LOCAL_RANK``.
        timeout_s: how long a collective may wait for the other ranks before failing
            (torch's default: 30 minutes for gloo, 10 for NCCL).

    Returns:
        The device this rank should put its model and data on.

    Raises:
        ValueError: an unknown backend, or NCCL without one GPU per local worker.
        RuntimeError: this process is not a worker (see :func:`get_contract`).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return _state["device"] or torch.device("cpu")
    contract = get_contract()
    chosen = backend or os.environ.get("MGTUTOR_BACKEND")
    store = None
    if not chosen and contract.world_size > contract.local_world_size:
        # Several launchers (torchrun's nodes): LOCAL_WORLD_SIZE counts only this one's workers,
        # and two can share a machine. The ranks meet at the store first and pick NCCL only if
        # every one of them has a GPU of its own on its machine.
        store = _rendezvous(contract, timeout_s)
        chosen = agree_on_backend(store, contract.rank, contract.world_size, _place(contract))
    chosen = chosen or backend_for(contract.local_world_size)
    if chosen not in BACKENDS:
        raise ValueError(f"unknown backend {chosen!r}; choose one of {BACKENDS}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if chosen == "nccl":
        if gpus <= contract.local_rank:
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank on each machine, but local rank "
                f"{contract.local_rank} has no GPU (CUDA sees {gpus}). Use backend='gloo'."
            )
        rank_device = torch.device("cuda", contract.local_rank)
        torch.cuda.set_device(rank_device)
    elif device == "cuda":
        if gpus == 0:
            raise ValueError("device='cuda' was asked for, but CUDA sees no GPU")
        rank_device = torch.device("cuda", contract.local_rank % gpus)
        torch.cuda.set_device(rank_device)
    elif device in (None, "cpu"):
        rank_device = torch.device("cpu")
    else:
        raise ValueError(f"device must be 'cpu', 'cuda' or None, got {device!r}")
    if "OMP_NUM_THREADS" not in os.environ:
        # Each rank is a process; without this every rank starts one thread per core for its
        # CPU work (a GPU rank has some too: data preparation, the optimizer on CPU tensors),
        # and they fight over the cores, which makes two ranks slower than one. torchrun
        # sets OMP_NUM_THREADS=1 for the same reason; a value the user set is kept.
        torch.set_num_threads(_threads_per_rank(contract))
    if contract.source == "slurm":
        os.environ.update(
            RANK=str(contract.rank),
            LOCAL_RANK=str(contract.local_rank),
            WORLD_SIZE=str(contract.world_size),
            LOCAL_WORLD_SIZE=str(contract.local_world_size),
        )
    os.environ.setdefault(INIT_BARRIER_ENV, "1")  # see INIT_BARRIER_ENV; a value set is kept
    options: dict[str, Any] = {}
    if timeout_s is not None:
        options["timeout"] = timedelta(seconds=timeout_s)
    if chosen == "nccl" and _accepts_device_id(dist.init_process_group):
        # Binds the group to this rank's GPU up front (torch >= 2.3): NCCL's communicator is
        # created eagerly for that device instead of guessed at the first collective.
        options["device_id"] = rank_device
    if store is not None:
        options["store"] = store
    else:
        options["init_method"] = "env://"
    dist.init_process_group(chosen, rank=contract.rank, world_size=contract.world_size, **options)
    _state.update(device=rank_device, backend=chosen)
    return rank_device


def _place(contract: WorkerContract) -> RankPlace:
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return RankPlace(socket.gethostname(), contract.local_rank, gpus, dist.is_nccl_available())


def _rendezvous(contract: WorkerContract, timeout_s: float | None) -> Any:
    """The rendezvous store that ``init_process_group(init_method="env://")`` would make."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = default_pg_timeout if timeout_s is None else timedelta(seconds=timeout_s)
    rendezvous = dist.rendezvous("env://", contract.rank, contract.world_size, timeout=timeout)
    store, _, _ = next(rendezvous)
    store.set_timeout(timeout)
    return store


def _accepts_device_id(init: Any) -> bool:
    import inspect

    try:
        return "device_id" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


def teardown() -> None:
    """Leave the process group if this process is in one (a worker's fn may call it itself)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        keep_destroyed_groups()
        dist.destroy_process_group()


# Process groups that destroy_process_group removed, kept referenced until the process exits
# (a rank ends with os._exit, which runs no destructor, so this costs nothing).
_destroyed_groups: set[Any] = set()
# Before torch 2.8 ~ProcessGroupGloo joins its workers with the GIL held, and a worker finishing
# a collective with a Python callback (a comm hook's fut.then) waits for the GIL: a deadlock
# (seen on 2.4.1). Fixed by pytorch/pytorch#154976 ("Release GIL in PG destructor"), in 2.8.
_FIXED_IN = (2, 8)


def keep_destroyed_groups() -> None:
    """On torch before 2.8, keep every current process group referenced for the process's life.

    Call it right before ``dist.destroy_process_group()``; mgtutor's ranks also call it through
    :func:`guard_destroy` when fn calls destroy_process_group itself. Does nothing on torch 2.8
    and later, whose process groups release the GIL while they are destroyed.
    """
    import torch.distributed.distributed_c10d as c10d

    if not _destroy_holds_gil():
        return
    world = getattr(c10d, "_world", None)
    _destroyed_groups.update(getattr(world, "pg_map", {}))


def _destroy_holds_gil() -> bool:
    from mgtutor.build import torch_release

    return torch_release() < _FIXED_IN


def guard_destroy() -> None:
    """Make ``dist.destroy_process_group`` keep the groups it destroys (torch before 2.8).

    Called once in each mgtutor rank, so that a training function that ends with the plain
    program's ``dist.destroy_process_group()`` cannot deadlock in it (see
    :func:`keep_destroyed_groups`). The function keeps its name, signature and docstring; on
    torch 2.8 and later it is left as it is.
    """
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    destroy = c10d.destroy_process_group
    if not _destroy_holds_gil() or getattr(destroy, "_mgtutor_guarded", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        keep_destroyed_groups()
        return destroy(*args, **kwargs)

    destroy_process_group._mgtutor_guarded = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def current_device() -> str:
    """Name the device :func:`setup` picked for this rank ("cpu" if setup was not called)."""
    device = _state["device"]
    return str(device) if device is not None else "cpu"


def current_backend() -> str | None:
    """Name the backend of this rank's process group, if :func:`setup` made one."""
    return _state["backend"]
