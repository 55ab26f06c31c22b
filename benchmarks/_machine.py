"""The machine and checkout a benchmark ran on, as every benchmark's JSON file records them.

Not a benchmark: :func:`machine` is the one record of where a result came from, so that every
script's JSON has the same keys (files written before it existed use others: ``python_version``,
``cpu_count``, ``torch_version`` in launch_latency's and timing_overhead's, ``machine`` for the
platform in step_check_spread's).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    """The checkout's commit (and "+changes" if mgtutor/ or benchmarks/ has uncommitted ones),
    or None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "mgtutor",
                                "benchmarks"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")  # fmt: skip


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran: the date (UTC), torch, Python, the platform, the CPU count,
    the build (:meth:`mgtutor.build.Build.describe`: CUDA, NCCL, accelerator) and the commit.

    Example:
        >>> sorted(machine())
        ['build', 'commit', 'cpus', 'date', 'platform', 'python', 'torch']
    """
    import torch

    from mgtutor.build import this_build

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "build": this_build().describe(),
        "commit": commit(),
    }
