"""Records of what a module's collectives did, kept for the ``with`` blocks that asked for them.

:mod:`.tensor_comms` and :mod:`.expert` write one record per collective they run; a learner's
``with count_collectives() as calls:`` (or ``count_all_to_all()``) block receives those run
inside it. Blocks may nest: each open block gets every record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["Tally"]


class Tally:
    """The open logs of one module's records."""

    def __init__(self) -> None:
        self._logs: list[list[Any]] = []

    @contextlib.contextmanager
    def count(self) -> Iterator[list[Any]]:
        """A list that receives every record written while the block runs."""
        log: list[Any] = []
        self._logs.append(log)
        try:
            yield log
        finally:
            self._logs.remove(log)

    def write(self, record: Any) -> None:
        """Give ``record`` to every open block."""
        for log in self._logs:
            log.append(record)
