"""The bytes a rank writes, read from Linux's ``/proc/self/io``: what gloo sent, beside the ring.

``wchar`` counts every byte passed to a write system call, by any thread: gloo's TCP transport
writes each message it sends, so across a collective it grows by what this rank sent plus a few
hundred bytes of headers per message. It also counts what the rank prints: a rank's stdout and
stderr are pipes to the notebook (:mod:`mgtutor.rank.loop`), and a warning torch prints inside
the window would count as sent. :class:`SocketWrites` leaves those out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import IO, Any

__all__ = ["SocketWrites", "bytes_written"]


def bytes_written() -> int | None:
    """Bytes this process (all threads) has passed to write system calls: ``wchar`` in Linux's
    ``/proc/self/io``; None elsewhere. Its printed output included: see :class:`SocketWrites`."""
    try:
        with open("/proc/self/io", encoding="ascii") as io:
            fields = dict(line.split(": ", 1) for line in io.read().splitlines() if ": " in line)
    except OSError:
        return None
    return int(fields["wchar"]) if "wchar" in fields else None


class SocketWrites:
    """Bytes this process wrote inside the block, less what it printed: ``nbytes`` after it.

    Inside the block file descriptors 1 and 2 point to temporary files (so C++ warnings are
    caught too), and ``sys.stdout`` and ``sys.stderr`` write to them; their bytes are subtracted
    from ``wchar``'s growth and then written to the streams they replaced, after the count.
    ``nbytes`` is None where there is no ``/proc/self/io`` (macOS, Windows). What is left is the
    sockets', and any other file's, writes.

    Example:
        >>> with SocketWrites() as written:
        ...     dist.all_reduce(torch.ones(8192))  # 32 KiB on 2 gloo ranks
        >>> written.nbytes  # 32,768 and the headers
    """

    def __init__(self) -> None:
        self.nbytes: int | None = None
        self._start: int | None = None
        self._saved: list[int] = []
        self._files: list[IO[bytes]] = []
        self._streams: tuple[Any, Any] = (None, None)

    def __enter__(self) -> SocketWrites:
        _flush()
        self._start = bytes_written()
        if self._start is not None:
            self._files = [tempfile.TemporaryFile() for _ in (1, 2)]  # noqa: SIM115 - closed on exit
            self._saved = [os.dup(fd) for fd in (1, 2)]
            for fd, file in zip((1, 2), self._files):
                os.dup2(file.fileno(), fd)
            # Python's streams onto those descriptors too: a notebook's or pytest's write elsewhere
            self._streams = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = (
                open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
                for fd in (1, 2)
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._start is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.close()  # flushed; the descriptors stay open
        end = bytes_written()
        sys.stdout, sys.stderr = self._streams
        printed = []
        for fd, saved, file in zip((1, 2), self._saved, self._files):
            os.dup2(saved, fd)
            os.close(saved)
            file.seek(0)
            printed.append(file.read())
            file.close()
        assert end is not None
        self.nbytes = end - self._start - sum(len(text) for text in printed)
        for stream, text in zip(self._streams, printed):  # after the count: shown, not counted
            if text and stream is not None:
                stream.write(text.decode("utf-8", errors="backslashreplace"))
                stream.flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
