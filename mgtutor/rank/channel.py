"""The worker's line back to the notebook: messages a rank sends while it runs.

Only a rank started by :func:`mgtutor.launch` or a :class:`mgtutor.Pool` has a channel.
Everything that reports to the parent (progress bars, the final result) goes through
:func:`send`, which does nothing when there is no channel, so the same training code also
runs under torchrun or in one process.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

_conn: Connection | None = None
_lock = threading.Lock()


def attach(conn: Connection) -> None:
    """Make ``conn`` this process's channel to the launching parent."""
    global _conn
    _conn = conn


def is_attached() -> bool:
    """Tell whether this process is a worker of :func:`mgtutor.launch`."""
    return _conn is not None


def send(message: Any) -> bool:
    """Send one message (a class of :mod:`mgtutor.wire.messages`) to the parent.

    Returns:
        False when there is no parent to send to, or it is gone.
    """
    if _conn is None:
        return False
    with _lock:  # a DataLoader thread and the main thread may both report progress
        try:
            _conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            return False
    return True
