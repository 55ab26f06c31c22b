"""How long the launcher's processes live: the idle timeout, and :func:`shutdown`.

A notebook that launched once keeps a rank server (the forkserver, with torch imported: about
400 MB) and each open :class:`~mgtutor.Pool` keeps its ranks, for as long as the kernel runs;
closing the browser tab does not end the kernel. So a pool's ranks that received no call for
``idle_timeout`` seconds are stopped, and the server too once it has no rank left and the
launcher did nothing for as long. The next call starts them again and says so in one line; a
pool's new ranks hold nothing of the old ones (models, optimizers, names).

The timeout is 10 minutes unless the environment variable ``MGTUTOR_IDLE_TIMEOUT`` says
otherwise (seconds, or ``off`` to keep idle processes until the kernel ends); a pool takes its
own with ``Pool(idle_timeout=...)``. :func:`shutdown` frees both at once.

A thread of the notebook's process keeps the clock. It stops nothing while a call, a start or a
close is under way anywhere in the launcher (:func:`keeps_busy`), and prints nothing: the next
call says what happened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from mgtutor.errors import ArgumentError

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "IDLE_TIMEOUT_ENV", "shutdown", "stop_server"]

IDLE_TIMEOUT_ENV = "MGTUTOR_IDLE_TIMEOUT"
DEFAULT_IDLE_TIMEOUT_S = 600.0
# Pool's default: read the environment at each check, so that a change made in a cell
# (``os.environ["MGTUTOR_IDLE_TIMEOUT"] = "off"``) applies to pools already open.
FROM_ENVIRONMENT = "from MGTUTOR_IDLE_TIMEOUT"
_OFF = ("off", "none", "never", "0")
# Longest sleep of the clock's thread: a timeout changed in the environment is seen this soon.
_RECHECK_S = 30.0


class _Watched:
    """What the clock knows of one pool: its timeout, its last call, whether it stopped it."""

    def __init__(self, timeout: float | str | None) -> None:
        self.timeout = timeout
        self.last_used = time.monotonic()
        self.stopped_after: float | None = None


_clock = threading.Condition()
_busy = 0
_last_activity = time.monotonic()
_pools: weakref.WeakKeyDictionary[Any, _Watched] = weakref.WeakKeyDictionary()
_server_stopped_after: float | None = None
_thread_pid: int | None = None


def idle_timeout(given: float | str | None = FROM_ENVIRONMENT) -> float | None:
    """Seconds idle processes are kept: ``given``, else ``MGTUTOR_IDLE_TIMEOUT``, else 600.

    Returns:
        The seconds, or None where idle processes are kept until the kernel ends.

    Raises:
        mgtutor.errors.ArgumentError: neither a positive number of seconds nor None / "off".
    """
    if isinstance(given, str) and given == FROM_ENVIRONMENT:
        text = os.environ.get(IDLE_TIMEOUT_ENV, "").strip().lower()
        if not text:
            return DEFAULT_IDLE_TIMEOUT_S
        if text in _OFF:
            return None
        try:
            given = float(text)
        except ValueError:
            raise ArgumentError(
                f"{IDLE_TIMEOUT_ENV}={text!r} is not a number of seconds: set it to e.g. 600 "
                f"(ten minutes), or to 'off' to keep idle ranks until the kernel ends"
            ) from None
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not given > 0:
        raise ArgumentError(
            f"idle_timeout must be a positive number of seconds or None (keep idle ranks "
            f"until the kernel ends), got {given!r}"
        )
    return float(given)


def describe(seconds: float) -> str:
    """``600`` -> "10 min", ``90`` -> "1.5 min", ``2`` -> "2 s"."""
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


@contextlib.contextmanager
def in_use(pool: Any = None) -> Iterator[None]:
    """Mark the launcher busy while the block runs: the clock stops nothing meanwhile.

    Waits, on entering, while the clock is stopping something; on leaving, restarts the idle
    time of the launcher and of ``pool``.
    """
    global _busy, _last_activity
    with _clock:
        _busy += 1
    try:
        yield
    finally:
        with _clock:
            _busy -= 1
            _last_activity = time.monotonic()
            watched = _pools.get(pool) if pool is not None else None
            if watched is not None:
                watched.last_used = _last_activity
                if watched.stopped_after is not None and pool.alive:
                    watched.stopped_after = None  # restarted (pool.restart()): nothing to say
            _clock.notify_all()


F = TypeVar("F", bound=Callable[..., Any])


def keeps_busy(method: F) -> F:
    """A Pool method that runs :func:`in_use` for its pool (a call, a start, a close)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with in_use(self):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def watch(pool: Any, timeout: float | str | None = FROM_ENVIRONMENT) -> None:
    """Stop ``pool``'s ranks once they had no call for ``timeout`` seconds (see the module)."""
    idle_timeout(timeout)  # refuse a bad value now, not in the clock's thread
    with _clock:
        _pools[pool] = _Watched(timeout)
        _start_clock()


@contextlib.contextmanager
def server_starts() -> Iterator[None]:
    """Around a start (or reuse) of the rank server: say so if the idle timeout had stopped it.

    Its idle time starts again when the block ends.
    """
    global _server_stopped_after, _last_activity
    with _clock:
        after, _server_stopped_after = _server_stopped_after, None
    if after is not None and _server_pid() is None:
        print(
            f"mgtutor: the rank server had stopped after {describe(after)} idle "
            f"({IDLE_TIMEOUT_ENV}); starting it again.",
            flush=True,
        )
    try:
        yield
    finally:
        with _clock:
            _last_activity = time.monotonic()
            _start_clock()
            _clock.notify_all()


def pool_note(pool: Any, kept: str) -> str | None:
    """The line a pool prints when it restarts ranks that the idle timeout stopped, or None."""
    with _clock:
        watched = _pools.get(pool)
        after = watched.stopped_after if watched is not None else None
        if watched is not None:
            watched.stopped_after = None
    if after is None:
        return None
    return (
        f"mgtutor: {kept[0].lower()}{kept[1:]} had stopped after {describe(after)} with no "
        f"call (the idle timeout, {IDLE_TIMEOUT_ENV}); starting new ones. What the old ranks "
        f"held (models, optimizers, names) is gone."
    )


def stop_server() -> bool:
    """Stop the rank server if it runs; the next launch starts it again. True if it ran.

    Its ranks are its children and die with it: call this only when no pool has ranks.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = _server_pid()
    if pid is None or not hasattr(server, "_stop"):
        return False
    try:
        # SIGTERM first: the server's handler (mgtutor.launcher._processes) exits at once,
        # without the interpreter's slow shutdown with torch loaded; _stop then reaps it.
        os.kill(pid, signal.SIGTERM)
    except OSError:
        pass
    try:
        server._stop()
    except OSError:  # reaped by someone else already: forget it, so the next start is clean
        # Private attributes of CPython's ForkServer, which typeshed does not declare.
        server._forkserver_pid = None  # type: ignore[attr-defined]
        server._forkserver_address = None  # type: ignore[attr-defined]
    return True


def shutdown() -> None:
    """Free what mgtutor keeps running for this notebook: every open pool, and the rank server.

    The kernel itself stays (Kernel > Shut Down in Jupyter ends it). The next launch, pool or
    ``%%ddp`` cell starts what it needs again.

    Example:
        >>> mgtutor.shutdown()
        mgtutor: closed 1 pool (2 ranks) and stopped the rank server.
    """
    with in_use():
        with _clock:
            pools = [p for p in list(_pools) if not p.closed]
        ranks = sum(p.world_size for p in pools if p.alive)
        for pool in pools:
            pool.close()
        stopped = stop_server()
    what = [f"closed {_count(len(pools), 'pool')} ({_count(ranks, 'rank')})"] if pools else []
    what += ["stopped the rank server"] if stopped else []
    print(f"mgtutor: {' and '.join(what) or 'nothing was running (no pool, no rank server)'}.")


def _server_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _server_has_ranks(pid: int) -> bool:
    import psutil

    try:
        children = psutil.Process(pid).children()
        return any(c.status() != psutil.STATUS_ZOMBIE for c in children)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: keep it


def _start_clock() -> None:
    """Start the clock's thread in this process, once (called with ``_clock`` held)."""
    global _thread_pid
    if _thread_pid != os.getpid():
        _thread_pid = os.getpid()
        threading.Thread(target=_keep_time, name="mgtutor-idle-clock", daemon=True).start()


def _keep_time() -> None:
    with _clock:
        while True:
            _clock.wait(_stop_what_is_idle(time.monotonic()))


def _timeout_or_keep(given: float | str | None) -> float | None:
    try:
        return idle_timeout(given)
    except ArgumentError:
        return None  # a bad MGTUTOR_IDLE_TIMEOUT: keep everything; the next pool says why


def _stop_what_is_idle(now: float) -> float:
    """Stop idle pools' ranks, then an idle server; return the seconds until the next check."""
    global _server_stopped_after
    if _busy:
        return _RECHECK_S  # in_use wakes the clock when it ends
    due = now + _RECHECK_S
    for pool, watched in list(_pools.items()):
        timeout = _timeout_or_keep(watched.timeout)
        if timeout is None or pool.closed or not pool.alive:
            continue
        if now - watched.last_used >= timeout:
            pool.stop_ranks()
            watched.stopped_after = timeout
        else:
            due = min(due, watched.last_used + timeout)
    timeout = _timeout_or_keep(FROM_ENVIRONMENT)
    pid = _server_pid()
    if timeout is not None and pid is not None:
        if now - _last_activity < timeout:
            due = min(due, _last_activity + timeout)
        elif not _server_has_ranks(pid) and stop_server():  # its ranks would die with it
            _server_stopped_after = timeout
    return max(due - time.monotonic(), 0.01)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
