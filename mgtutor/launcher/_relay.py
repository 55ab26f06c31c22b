"""Relay what a rank writes into the cell, one whole line at a time, tagged with its rank.

A rank's stdout and stderr are pipes to the notebook's process (at the descriptor level, so
C++ and NCCL output come too). :class:`RankOutput` cuts what arrives into lines and writes each
as ``[rank r] ...`` to the notebook's own stdout or stderr, so lines of two ranks never mix and
output reaches the cell even under nbval (ipykernel does not forward a child's output there).
It also keeps the rank's faulthandler dumps (the ``diag`` pipe). A rank flushes its output
before it answers a call, so when the answer arrives everything the rank wrote during the call
is already in the pipes (a pipe's write is complete when it returns): :meth:`RankOutput.drain`
relays it then, without waiting for more.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

# Lines drawn with a carriage return (tqdm) are shown at most this often per rank and stream.
_REDRAW_S = 0.5
# At the end of a call, at most this many reads per stream: what a rank's other threads keep
# writing after it answered is relayed by the next waits instead of holding the answer back.
_DRAIN_READS = 16
STREAMS = ("stdout", "stderr")


@dataclass
class RankOutput:
    """The notebook's end of one rank's stdout, stderr and stack-dump pipes.

    Attributes:
        rank: whose output this is.
        pipes: "stdout", "stderr" and "diag" pipe ends (read only).
        open: the names of the pipes not yet at end of file.
        diag: everything read from the stack-dump pipe.
        ended: for each stream, the last call whose output has all been relayed.
        sink: where each relayed line goes instead of the cell (``sink(rank, stream, text)``),
            e.g. a tab.
    """

    rank: int
    pipes: dict[str, Connection]
    open: set[str] = field(default_factory=set)
    diag: bytearray = field(default_factory=bytearray)
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0))
    sink: Callable[[int, str, str], None] | None = None
    written: bool = False  # a line was relayed since take_written() last asked
    _partial: dict[str, bytes] = field(default_factory=dict)
    _redrawn: dict[str, str] = field(default_factory=dict)
    _redrawn_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.open = set(self.pipes)

    def relayed(self, call: int) -> bool:
        """True once everything the rank wrote up to the end of ``call`` has been relayed."""
        return all(self.ended[s] >= call or s not in self.open for s in STREAMS)

    def read(self, name: str) -> None:
        """Read what is waiting on pipe ``name`` and relay its complete lines."""
        try:
            data = os.read(self.pipes[name].fileno(), 65536)
        except OSError:
            data = b""
        if name == "diag":
            if data:
                self.diag += data
            else:
                self.open.discard(name)
            return
        buffered = self._partial.get(name, b"") + data
        *lines, rest = buffered.split(b"\n")
        if not data:  # end of file: what is left is a last line without a newline
            lines, rest = ([*lines, rest] if rest else lines), b""
            self.open.discard(name)
        for line in lines:
            text = _as_drawn(line)
            if self._redrawn.pop(name, None) == text:
                continue  # its last drawing is already on screen
            self._write(name, text)
        if b"\r" in rest:
            # A line redrawn in place (tqdm): show what a terminal shows now, at most every
            # _REDRAW_S, instead of holding it back until the next newline.
            drawn = rest.rstrip(b"\r")
            if b"\r" in drawn:
                rest = rest[drawn.rindex(b"\r") :]  # what came before is drawn over
            text = _as_drawn(rest)
            now = time.monotonic()
            due = now - self._redrawn_at.get(name, 0.0) >= _REDRAW_S
            if text and due and text != self._redrawn.get(name):
                self._write(name, text)
                self._redrawn[name] = text
                self._redrawn_at[name] = now
        self._partial[name] = rest

    def drain(self, call: int) -> None:
        """Relay what the rank wrote up to its answer to ``call``, which has just arrived.

        The rank flushed its output before answering, so all of it is in the pipes now: read
        what is there (without waiting), end a last line that had no newline, and mark
        ``call``'s output as relayed.
        """
        waiting = _readable([self.pipes[name] for name in STREAMS if name in self.open])
        for name in STREAMS:
            pipe = self.pipes[name]
            ready = pipe in waiting  # a silent call costs one look at both pipes
            for _ in range(_DRAIN_READS):
                if name not in self.open or not ready:
                    break
                self.read(name)
                ready = bool(_readable([pipe]))
            rest = self._partial.pop(name, b"")
            if rest:
                text = _as_drawn(rest)
                if self._redrawn.pop(name, None) != text:
                    self._write(name, text)
            self.ended[name] = call

    def take_written(self) -> bool:
        """True if a line was relayed since the last time this was asked."""
        written, self.written = self.written, False
        return written

    def _write(self, name: str, text: str) -> None:
        self.written = True
        if self.sink is not None:
            self.sink(self.rank, name, text)
            return
        target = sys.stdout if name == "stdout" else sys.stderr
        target.write(f"[rank {self.rank}] {text}\n")

    def close(self) -> None:
        """Close the notebook's ends of the pipes."""
        for conn in self.pipes.values():
            conn.close()
        self.open.clear()


def _readable(conns: list[Connection]) -> list[Connection]:
    """Those of ``conns`` with something to read now (one system call for all of them)."""
    if not conns:
        return []
    try:
        ready = set(select.select([c.fileno() for c in conns], [], [], 0)[0])
    except (OSError, ValueError):
        return []
    return [c for c in conns if c.fileno() in ready]


def _as_drawn(line: bytes) -> str:
    """What a terminal shows for ``line``: the text after its last carriage return."""
    segments = [part for part in line.split(b"\r") if part]
    return segments[-1].decode("utf-8", "replace") if segments else ""
