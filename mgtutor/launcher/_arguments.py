"""Every argument of a pool and of launch, checked once, before any process starts.

:class:`mgtutor.Pool` calls these (and :func:`mgtutor.launch` is a pool's one call): each error
says what was given and what to pass instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mgtutor.build import StartMethod, rank_start_method
from mgtutor.errors import ArgumentError
from mgtutor.worker import BACKENDS

__all__ = [
    "START_METHODS",
    "backend_asked_for",
    "check_arguments",
    "check_ranks",
    "check_seconds",
    "default_start_method",
]

START_METHODS = ("forkserver", "spawn")


def default_start_method() -> StartMethod:
    """How ranks start unless told: a forkserver where forking after torch is safe (Linux),
    else spawn (macOS: see :func:`mgtutor.build.rank_start_method`)."""
    return rank_start_method()


def backend_asked_for(backend: str | None) -> str | None:
    """backend, else this process's MGTUTOR_BACKEND (each rank's setup() reads it), else None.

    Raises:
        mgtutor.errors.ArgumentError: MGTUTOR_BACKEND names no backend.
    """
    named = os.environ.get("MGTUTOR_BACKEND") or None
    if backend is not None or named in (None, *BACKENDS):
        return backend or named
    raise ArgumentError(
        f"MGTUTOR_BACKEND={named!r} in this process's environment is not one of {BACKENDS}; "
        f"set it to one of them, or unset it to let each rank choose"
    )


def check_seconds(name: str, value: object) -> None:
    """Refuse a time limit that is not a positive number of seconds or None (no limit)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise ArgumentError(
            f"{name} must be a positive number of seconds or None (no limit), got {value!r}"
        )


def check_arguments(
    world_size: object, backend: object, start_timeout: object, start_method: object
) -> None:
    """Refuse a pool's bad arguments before any process starts, saying what to pass instead."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ArgumentError(f"world_size must be a whole number, got {world_size!r}")
    if world_size < 1:
        raise ArgumentError(
            f"world_size must be at least 1 (one worker per rank), got {world_size}"
        )
    if backend is not None and backend not in BACKENDS:
        raise ArgumentError(
            f"backend must be one of {BACKENDS} or None (choose for me), got {backend!r}"
        )
    check_seconds("start_timeout", start_timeout)
    if start_method is not None and start_method not in START_METHODS:
        raise ArgumentError(
            f"start_method must be one of {START_METHODS} (or None for "
            f"{default_start_method()!r}), got {start_method!r}. 'fork' is not offered: a forked "
            f"rank inherits the notebook's CUDA state and fails once CUDA was used there."
        )
    if start_method == "forkserver" and default_start_method() != "forkserver":
        raise ArgumentError(
            "start_method='forkserver' is not offered on this system: the server imports torch "
            "and forks every rank from it, and on macOS a forked child of a process that ever "
            "had a second thread aborts when it initialises an Objective-C class. Pass "
            "start_method='spawn' or None (spawn is the default here)."
        )
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        # device_count() asks NVML and leaves CUDA uninitialized in the notebook's process
        # (is_available() would initialize it, which breaks fork-based tools used later).
        gpus = torch.cuda.device_count()
        if gpus < world_size or not dist.is_nccl_available():
            why = (
                "this torch has no NCCL"
                if not dist.is_nccl_available()
                else f"CUDA sees {gpus} GPU(s)"
            )
            raise ArgumentError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size}, but {why}. "
                f"Use backend='gloo' (or None to choose automatically), or world_size<={gpus}."
            )


def check_ranks(ranks: Sequence[int] | int | None, world_size: int) -> list[int]:
    """The ranks a call goes to, sorted: every rank for None.

    Raises:
        mgtutor.errors.ArgumentError: a rank outside the pool, or none at all.
    """
    if ranks is None:
        return list(range(world_size))
    chosen = sorted({ranks} if isinstance(ranks, int) else set(ranks))
    wrong = [r for r in chosen if not isinstance(r, int) or not 0 <= r < world_size]
    if wrong or not chosen:
        raise ArgumentError(
            f"ranks must name ranks of this pool (0..{world_size - 1}), got {ranks!r}"
        )
    return chosen
