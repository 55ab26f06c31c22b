"""The loop that listens to every rank at once: answers, output, progress and exits.

:class:`RankWatch` waits on every rank's message pipe, output pipes and process handle in one
selector, relays output as it comes (:mod:`._relay`), updates the progress bars, and records
each rank's answer or failure on its :class:`~._handle.RankHandle`. It decides nothing: the
:class:`~._supervise.Supervisor` built on it decides when a call has ended or failed.
"""

from __future__ import annotations

import select
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from mgtutor.launcher._handle import RankHandle
from mgtutor.launcher.progress_bars import ProgressBoard
from mgtutor.wire.messages import Call, Done, Exit, Failed, Hello, Progress, Ready

__all__ = ["POLL_S", "RankWatch", "ended_sentinels"]

# The longest a wait for the ranks listens before it looks at its clocks again.
POLL_S = 0.1


class RankWatch:
    """The ranks of one pool (or one launch), and what each has sent so far."""

    def __init__(self) -> None:
        self.handles: list[RankHandle] = []
        self.board: ProgressBoard | None = None
        # The poll object of _pump, kept while the set it watches stays the same (building one
        # registers every pipe again at every wait), and what each of its descriptors is.
        self._poller: Any = None
        self._polled: dict[int, Any] = {}
        self._selected: set[Any] = set()
        self._printed = False  # a Progress message printed a line since the last flush
        # Whether a process may have ended since the last look (an exit or a closed pipe was
        # seen, or a wait timed out): only then is each rank's exit looked at (_reap).
        self.maybe_ended = True

    def add(self, handle: RankHandle) -> None:
        """Watch one more started rank."""
        self.handles.append(handle)

    def send(self, h: RankHandle, message: Call | Exit) -> bool:
        """Send a message to a rank; False when its pipe is closed (the rank has gone)."""
        return self.send_pickled(h, ForkingPickler.dumps(message))  # as Connection.send does

    def send_pickled(self, h: RankHandle, message: bytes | memoryview) -> bool:
        """:meth:`send` for a message pickled once for every rank (``ForkingPickler.dumps``)."""
        try:
            h.conn.send_bytes(message)
            return True
        except (OSError, ValueError):
            return False

    def _watched(self) -> dict[Any, tuple[RankHandle, str]]:
        watched: dict[Any, tuple[RankHandle, str]] = {}
        for h in self.handles:
            if h.closed:
                continue
            if h.conn_open:
                watched[h.conn] = (h, "conn")
            for name in h.output.open:
                watched[h.output.pipes[name]] = (h, name)
            if h.exitcode is None:
                watched[h.process.sentinel] = (h, "exit")
        return watched

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for anything from the ranks and handle it; True if any came."""
        watched = self._watched()
        if not watched:
            time.sleep(timeout)
            return False
        ready = self._wait(watched, timeout)
        if not ready or any(watched[obj][1] == "exit" for obj in ready):
            self.maybe_ended = True
        # Output first: an answer then relays the rest of its rank's output (drain), after
        # which a pipe this wait saw readable may be empty.
        for obj in sorted(ready, key=lambda o: watched[o][1] == "conn"):
            handle, what = watched[obj]
            if what == "conn":
                self._receive(handle)
            elif what != "exit":
                handle.output.read(what)
        # Only after something was printed: in a kernel, each flush waits for ipykernel's IO
        # thread, even with nothing to send.
        if any([h.output.take_written() for h in self.handles]) or self._printed:
            self._printed = False
            sys.stdout.flush()
            sys.stderr.flush()
        return bool(ready)

    def _wait(self, watched: dict[Any, tuple[RankHandle, str]], timeout: float) -> list[Any]:
        """The objects of ``watched`` ready to read (or closed), waiting up to ``timeout`` s."""
        if not hasattr(select, "poll"):
            return wait(list(watched), timeout)
        if self._poller is None or self._selected != watched.keys():
            self._poller = select.poll()
            self._polled = {}
            self._selected = set(watched)
            for obj in watched:
                fd = obj if isinstance(obj, int) else obj.fileno()
                self._poller.register(fd, select.POLLIN)
                self._polled[fd] = obj
        milliseconds = None if timeout is None else max(0.0, timeout) * 1000
        return [self._polled[fd] for fd, _ in self._poller.poll(milliseconds)]

    def _receive(self, h: RankHandle) -> None:
        try:
            message = h.conn.recv()
        except (EOFError, OSError):
            h.conn_open = False
            self.maybe_ended = True
            return
        if isinstance(message, Progress):
            if self.board is not None:
                self.board.update(h.rank, message.step, message.total, message.desc)
                self._printed = True
        elif isinstance(message, Done) and message.call == h.call:
            h.output.drain(message.call)
            h.done = message
            h.children.update(message.record.get("children", []))
        elif isinstance(message, Failed) and message.call in (h.call, 0):
            h.output.drain(message.call)
            h.error = message
            h.failed_at = message.when
        elif isinstance(message, Hello):
            h.main_ident = message.main_ident
        elif isinstance(message, Ready):
            h.ready, h.backend = True, message.backend

    def _reap(self) -> None:
        self.maybe_ended = False
        running = [h for h in self.handles if h.exitcode is None]
        if not running:
            return
        # One look at every rank's exit (a forkserver rank's is_alive is a wait of its own).
        ended = ended_sentinels([h.process.sentinel for h in running])
        for h in running:
            if h.process.sentinel not in ended or h.process.is_alive():
                continue
            h.process.join(0)
            h.exitcode = h.process.exitcode
            while h.conn_open and self._poll(h.conn):
                self._receive(h)
            if h.failed_at is None and h.exit_asked_at is None and h.done is None:
                h.failed_at = time.perf_counter()  # it ended without answering

    @staticmethod
    def _poll(conn: Connection) -> bool:
        try:
            return conn.poll(0)
        except (EOFError, OSError):
            return False


def ended_sentinels(sentinels: list[int]) -> list[int]:
    """The process sentinels that are readable now (their processes ended), without waiting."""
    if not hasattr(select, "poll"):
        return [s for s in wait(sentinels, 0) if isinstance(s, int)]  # all are: sentinels
    poller = select.poll()
    for fd in sentinels:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(0)]
