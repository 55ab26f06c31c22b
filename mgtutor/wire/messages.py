"""The messages that travel between the notebook and its ranks, one class each.

Every message is a small frozen dataclass, pickled over the pipe that joins the notebook's
process to one rank (:mod:`mgtutor.rank.channel` on the rank's side). The notebook sends a rank
:class:`Call` and :class:`Exit`; a rank answers with the others. Each message about a call
carries the call's number, so a late answer to an earlier call is never taken for this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# --- notebook -> rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """The notebook's surroundings a rank takes on before it runs anything.

    A forkserver rank would otherwise have the server's, from when the server started.

    Attributes:
        environ: the notebook's ``os.environ``.
        cwd: its working folder.
        sys_path: its ``sys.path``.
    """

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]


@dataclass(frozen=True)
class Call:
    """Run a function once on this rank.

    Attributes:
        call: the call's number in this pool (1, 2, ...).
        payload: ``cloudpickle.dumps((fn, args, kwargs))``.
        sources: text of the notebook cells by linecache name, so tracebacks show cell lines
            (only cells the rank has not been sent yet).
        context: the notebook's environment, folder and import path now; None when they did
            not change since the last call to this rank.
        in_namespace: run fn with the rank's own global namespace (kept between calls) instead
            of the globals it was pickled with.
        reusable: the payload holds only values that cannot change in place
            (:mod:`~mgtutor.launcher._payload`): a rank may keep what it unpickled and use it
            again when the next call's payload is the same bytes.
    """

    call: int
    payload: bytes
    sources: dict[str, list[str]]
    context: Context | None
    in_namespace: bool = False
    reusable: bool = False


@dataclass(frozen=True)
class Exit:
    """Leave the process group and end the rank process."""


# --- rank -> notebook ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The rank process runs; its stack-dump handler is installed."""

    pid: int
    main_ident: int  # the main thread's id, to find it in a faulthandler dump


@dataclass(frozen=True)
class Ready:
    """The rank has joined the process group (when the pool makes one) and waits for calls.

    Attributes:
        backend: the backend of the group it joined, as torch names it; None when it made none.
    """

    backend: str | None = None


@dataclass(frozen=True)
class Progress:
    """A progress report from :func:`mgtutor.progress`."""

    step: int
    total: int
    desc: str


@dataclass(frozen=True)
class Done:
    """fn returned: its pickled result and what the rank measured while it ran."""

    call: int
    result: bytes
    record: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    """fn raised, could not be unpacked, or its result could not be sent back.

    Attributes:
        call: the call's number (0: the rank failed before any call, joining the group).
        exc_type: qualified name of the exception.
        message: its message.
        traceback: the formatted traceback in the rank.
        original: the exception pickled with cloudpickle, or None where it could not be.
        context: what the rank was doing, said as a verb phrase ("raised", ...).
        when: ``time.perf_counter()`` in the rank, to tell which rank failed first.
        record: the rank's record of its collectives when it failed (:mod:`mgtutor.doctor`),
            or None where there is none (no process group, no recorder in this torch).
    """

    call: int
    exc_type: str
    message: str
    traceback: str
    original: bytes | None
    context: str
    when: float
    record: dict[str, Any] | None = None
