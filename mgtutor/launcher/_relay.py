"""Relay what a rank writes into the cell, one whole line at a time, tagged with its rank.

A rank's stdout and stderr are pipes to the notebook's process (at the descriptor level, so
C++ and NCCL output come too). :class:`RankOutput` cuts what arrives into lines and writes each
as ``[rank r] ...`` to the notebook's own stdout or stderr, so lines of two ranks never mix and
output reaches the cell even under nbval (ipykernel does not forward a child's output there).
It also keeps the rank's faulthandler dumps (the ``diag`` pipe) and notices the marker a rank
writes after each call, which tells that a call's output has all been relayed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from mgtutor.launcher._messages import end_marker

# Lines drawn with a carriage return (tqdm) are shown at most this often per rank and stream.
_REDRAW_S = 0.5
STREAMS = ("stdout", "stderr")


@dataclass
class RankOutput:
    """The notebook's end of one rank's stdout, stderr and stack-dump pipes.

    Attributes:
        rank: whose output this is.
        pipes: "stdout", "stderr" and "diag" pipe ends (read only).
        open: the names of the pipes not yet at end of file.
        diag: everything read from the stack-dump pipe.
        ended: for each stream, the last call whose end marker came through it.
        sink: where each relayed line goes instead of the cell (``sink(rank, stream, text)``),
            e.g. a tab.
    """

    rank: int
    pipes: dict[str, Connection]
    open: set[str] = field(default_factory=set)
    diag: bytearray = field(default_factory=bytearray)
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STREAMS, 0))
    sink: Callable[[int, str, str], None] | None = None
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
            if b"\x00mgtutor-end " in line:
                before, _, after = line.rpartition(b"\x00mgtutor-end ")
                if after.isdigit() and b"\x00mgtutor-end " + after == end_marker(int(after)):
                    self.ended[name] = int(after)
                    if not before:
                        continue
                    line = before  # fn's last line had no newline; the marker ended it
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

    def _write(self, name: str, text: str) -> None:
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


def _as_drawn(line: bytes) -> str:
    """What a terminal shows for ``line``: the text after its last carriage return."""
    segments = [part for part in line.split(b"\r") if part]
    return segments[-1].decode("utf-8", "replace") if segments else ""
