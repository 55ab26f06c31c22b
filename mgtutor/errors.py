"""The exceptions a launch raises when a worker fails, hangs or is killed.

Every error names the rank, says what happened and what was cleaned up, and carries the
worker's own traceback or stack so a learner can find the line that failed.

In a notebook these errors open with their message: IPython shows what an exception's
``_render_traceback_`` returns in place of its own traceback (ipyparallel uses the same hook for
its engines' errors), and here that is the message, the line of the notebook that made the call,
and none of mgtutor's own frames. ``__tracebackhide__`` alone cannot do this: IPython always
shows the frame that raised, and prints the message after the frames. The full traceback is
always in ``err.__traceback__``; IPython shows it after ``%xmode --show`` (then ``%tb`` shows
the last error again), or when the environment variable ``MGTUTOR_FULL_TRACEBACK`` is set to 1.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

# mgtutor's folder, which holds this module: frames from files under it are the package's own.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def in_mgtutor(filename: str) -> bool:
    """Whether ``filename`` is one of mgtutor's own files (whose frames a learner need not read)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


__all__ = [
    "ArgumentError",
    "WorkerError",
    "WorkerTimeout",
    "WorkerInterrupted",
    "PicklingError",
    "PoolClosed",
    "FULL_TRACEBACK_ENV",
    "in_mgtutor",
    "strip_ansi",
]

# ECMA-48 control sequences (colours, bold) and the two-character escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape codes: a traceback as plain lines.

    Python 3.13 colours the tracebacks it prints (``sys.excepthook``) where ``FORCE_COLOR`` or
    ``PYTHON_COLORS=1`` is set, or stderr is a terminal; ipykernel sets ``FORCE_COLOR=1`` in the
    kernel's environment (``ZMQInteractiveShell.init_environment``), so every process started
    from a notebook colours its tracebacks, and a line that says ``AttributeError: ...`` begins
    with an escape code. Read a rank's or a child's traceback through this.

    Example:
        >>> strip_ansi("\\x1b[1;35mAttributeError\\x1b[0m: \\x1b[35mno\\x1b[0m")
        'AttributeError: no'
    """
    return _ANSI.sub("", text)


FULL_TRACEBACK_ENV = "MGTUTOR_FULL_TRACEBACK"
_HOW_TO_SEE_ALL = (
    f"(mgtutor's own frames are hidden. For the full traceback: %xmode --show, then %tb; or set "
    f"{FULL_TRACEBACK_ENV}=1.)"
)

# What mgtutor.doctor can name as the cause: ranks that did not call the same collectives.
_DESYNCS = ("behind", "finished", "order", "operation", "shape", "dtype", "p2p")


class _MessageFirst(Exception):
    """An error IPython shows message first, without mgtutor's frames (see the module docstring)."""

    def _render_traceback_(self) -> list[str]:
        return _render_message_first(self)


def _render_message_first(error: BaseException) -> list[str]:
    """The lines IPython shows for an mgtutor error: its message, then where the notebook called.

    The frames of mgtutor's own files, and those marked ``__tracebackhide__`` (IPython's own),
    are left out, and so are the exceptions it was raised from. With ``%xmode --show`` or
    ``MGTUTOR_FULL_TRACEBACK=1`` it is IPython's full traceback instead.

    Returns:
        The lines, for IPython's ``_render_traceback_`` hook.
    """
    shell = _ipython()
    full = os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0")
    if shell is not None and (full or not getattr(shell.InteractiveTB, "skip_hidden", True)):
        return shell.InteractiveTB.structured_traceback(
            type(error), error, error.__traceback__, tb_offset=1
        )
    lines = [f"{type(error).__name__}: {error}"]
    called = _calls_outside_mgtutor(error, shell)
    if called:
        lines += ["", "Called from:", *called]
    return [*lines, "", _HOW_TO_SEE_ALL]


def _ipython() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _calls_outside_mgtutor(error: BaseException, shell: Any) -> list[str]:
    """The traceback's frames outside mgtutor's and IPython's files, oldest first."""
    import linecache

    hidden = [_PACKAGE_DIR]
    if shell is not None:
        import IPython

        hidden.append(os.path.dirname(os.path.abspath(IPython.__file__)) + os.sep)
    lines = []
    tb = error.__traceback__
    while tb is not None:
        frame, lineno = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
        filename = frame.f_code.co_filename
        if frame.f_locals.get("__tracebackhide__") or os.path.abspath(filename).startswith(
            tuple(hidden)
        ):
            continue
        source = linecache.getline(filename, lineno).strip()
        if source.startswith("get_ipython().run_cell_magic("):
            continue  # a %%ddp cell: the cell is the call
        named = shell.compile.format_code_name(filename) if shell is not None else None
        place = f"{named[0]} {named[1]}" if named else f'File "{filename}"'
        lines.append(f"  {place}, line {lineno}, in {frame.f_code.co_name}")
        if source:
            lines.append(f"    {source}")
    return lines


class ArgumentError(_MessageFirst, ValueError, TypeError):
    """A launch, a pool call or a ``%%ddp`` line was given a bad argument; nothing was started.

    Both a :class:`ValueError` and a :class:`TypeError` (what Python raises for a bad value or
    type), so ``except ValueError`` and ``except TypeError`` keep catching it; in a notebook it
    shows its message first, like the other errors here.
    """


class PicklingError(_MessageFirst, pickle.PicklingError):
    """fn or an argument cannot be sent to the ranks (nothing was started).

    A :class:`pickle.PicklingError`, so ``except pickle.PicklingError`` catches it; its message
    names the variable or argument that holds what cannot be pickled.
    """


class PoolClosed(_MessageFirst, RuntimeError):
    """A pool was used after ``pool.close()`` or :func:`mgtutor.shutdown` ended its ranks.

    A :class:`RuntimeError`; in a notebook it shows its message first, like the other errors here.
    """


class WorkerError(_MessageFirst, RuntimeError):
    """A worker of :func:`mgtutor.launch` failed: it raised, exited early or was killed.

    Attributes:
        rank: the rank that failed first.
        exc_type: the qualified name of the exception the worker raised (``None`` if it died
            without raising, for example killed by a signal).
        exc_message: that exception's message.
        worker_traceback: the worker's formatted traceback (empty if it died without one).
        exitcode: the worker process's exit code; negative means killed by signal ``-exitcode``.
        signal_name: the signal's name (``"SIGKILL"``) when the worker was killed by one.
        cleanup: a sentence saying which other ranks were stopped.
        original: the worker's exception object when it could be sent back, else ``None``.
        diagnosis: what the ranks' records of their collectives say went wrong
            (:class:`mgtutor.doctor.Diagnosis`, its raw records in ``.records``), or None.
    """

    def __init__(
        self,
        summary: str,
        *,
        rank: int,
        exc_type: str | None = None,
        exc_message: str = "",
        worker_traceback: str = "",
        exitcode: int | None = None,
        signal_name: str | None = None,
        cleanup: str = "",
        original: BaseException | None = None,
        diagnosis: Any = None,
    ) -> None:
        self.summary = summary
        self.diagnosis = diagnosis
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.cleanup = cleanup
        self.original = original
        super().__init__(self._compose())

    def _compose(self) -> str:
        parts = _lead(self.summary, self.diagnosis)
        if self.cleanup:
            parts.append(self.cleanup)
        if self.worker_traceback:
            parts.append(f"\nTraceback in rank {self.rank}:\n{self.worker_traceback.rstrip()}")
        return "\n".join(parts)


class WorkerTimeout(WorkerError):
    """The launch ran past its ``timeout``; every rank was stopped.

    Attributes:
        running: the ranks that had not finished when the time ran out.
        stacks: for each of those ranks, the Python stack it was in (from ``faulthandler``).
    """

    def __init__(
        self,
        summary: str,
        *,
        running: list[int],
        stacks: dict[int, str],
        cleanup: str = "",
        diagnosis: Any = None,
    ) -> None:
        self.running = running
        self.stacks = stacks
        super().__init__(
            summary, rank=running[0] if running else -1, cleanup=cleanup, diagnosis=diagnosis
        )

    def _compose(self) -> str:
        parts = _lead(self.summary, self.diagnosis)
        if self.cleanup:
            parts.append(self.cleanup)
        parts += _where(self.running, self.stacks, "was stuck")
        return "\n".join(parts)


class WorkerInterrupted(KeyboardInterrupt):
    """The cell was interrupted (Stop, Kernel > Interrupt, Ctrl+C) while ranks ran.

    A :class:`KeyboardInterrupt`, so ``except KeyboardInterrupt`` catches it and ``except
    Exception`` does not (an interrupt still stops a loop of launches). It opens, like a
    timeout, with what the ranks' records of their collectives say (the rank that never reached
    a collective its peers wait in), then says which ranks were stopped and where each was.

    Attributes:
        summary: what was interrupted, and what became of the ranks.
        running: the ranks that had not finished when the cell was interrupted.
        stacks: for each of those ranks, the Python stack it was in (empty where none came).
        cleanup: a sentence saying which ranks were stopped ("" when a pool kept them).
        diagnosis: what the ranks' records say (:class:`mgtutor.doctor.Diagnosis`), or None.
    """

    def __init__(
        self,
        summary: str,
        *,
        running: list[int],
        stacks: dict[int, str],
        cleanup: str = "",
        diagnosis: Any = None,
    ) -> None:
        self.summary = summary
        self.running = running
        self.stacks = stacks
        self.cleanup = cleanup
        self.diagnosis = diagnosis
        parts = _lead(summary, diagnosis)
        if cleanup:
            parts.append(cleanup)
        parts += _where([r for r in running if r in stacks], stacks, "was")
        super().__init__("\n".join(parts))

    def _render_traceback_(self) -> list[str]:
        return _render_message_first(self)


def _lead(summary: str, found: Any) -> list[str]:
    """The doctor's finding first, when it found something; then the summary."""
    if found is None or found.kind == "agree":
        return [summary]
    if found.kind not in _DESYNCS:
        # A missing record (a rank that died) or no recorder: the summary says more.
        return [summary, f"(The ranks' records of collectives: {found.summary}.)"]
    details = [f"  {line}" for line in found.details]
    return [found.summary, *details, summary]


def _where(ranks: list[int], stacks: dict[int, str], was: str) -> list[str]:
    """Each rank's stack under a heading, in rank order."""
    parts = []
    for rank in ranks:
        stack = stacks.get(rank, "").rstrip() or "  (no stack came back from this rank)"
        parts.append(f"\nWhere rank {rank} {was} (most recent call last):\n{stack}")
    return parts
