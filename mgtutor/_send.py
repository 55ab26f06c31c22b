"""What travels to the ranks with each call: the function, its arguments, the cells' text.

A function defined in a notebook cell cannot be pickled by name (the ranks have no such
module), so it is pickled *by value* with cloudpickle, with the globals it uses; the text of the
notebook's cells goes along, so that a rank's traceback can show the cell's lines; and the
notebook's environment, of which some variables act only when a process group is made.
"""

from __future__ import annotations

import linecache
import os
import pickle
import sys
from collections.abc import Callable, Collection
from typing import Any

from mgtutor._messages import Context

_MAX_SOURCE_BYTES = 2_000_000
# Variables that act only when a process group is made: changed after the pool's ranks made
# theirs, they do nothing until new ranks make a new one.
_GROUP_NAMES = ("TORCH_DISTRIBUTED_DEBUG", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_GROUP_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_GLOO_")


def context_now() -> Context:
    """The notebook's environment, folder and import path, as a rank should take them on."""
    return Context(dict(os.environ), os.getcwd(), list(sys.path))


def context_key() -> tuple[Any, ...]:
    """What :func:`context_now` depends on, cheap to take and compare at every call.

    ``os.environ`` decodes every name and value when copied (about 20 us); its raw bytes
    mapping, where there is one, is copied in about 1 us.
    """
    raw = getattr(os.environ, "_data", None)
    environ = dict(raw) if isinstance(raw, dict) else dict(os.environ)
    return environ, os.getcwd(), tuple(sys.path)


def pickle_payload(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        culprit = "the function (or a global or closure variable it uses)"
        parts: list[tuple[str, Any]] = [("fn", fn)]
        parts += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
        for name, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception:
                culprit = name if name != "fn" else culprit
                break
        raise pickle.PicklingError(
            f"mgtutor could not send {culprit} to the workers: {exc}. Each worker is a "
            f"new process and gets a pickled copy; create objects such as locks, open files, "
            f"sockets or generators inside the function instead of passing them in."
        ) from exc


def cell_sources(sent: Collection[str] = ()) -> dict[str, list[str]]:
    """The text of notebook cells (they have no file), so worker tracebacks can show lines.

    IPython adds each executed cell to ``linecache`` under a name of its own, oldest first.
    The newest cells are the ones a launch most likely runs, so they are taken first, up to a
    size limit that keeps a long session's history from slowing every launch. Cells named in
    ``sent`` (the ranks have them) are left out before anything is looked up.
    """
    sources: dict[str, list[str]] = {}
    size = 0
    for filename, entry in reversed(list(linecache.cache.items())):
        if filename in sent:
            continue
        if len(entry) != 4 or entry[1] is not None or os.path.exists(filename):
            continue
        lines = list(entry[2])
        cost = sum(map(len, lines))
        if size + cost > _MAX_SOURCE_BYTES:
            continue
        size += cost
        sources[filename] = lines
    return sources


def group_variables(environ: dict[str, str]) -> dict[str, str]:
    """The variables torch reads only when a process group is made."""
    return {k: v for k, v in environ.items() if k in _GROUP_NAMES or k.startswith(_GROUP_PREFIXES)}


def changes(before: dict[str, str], after: dict[str, str]) -> str:
    """``NAME (before -> after)`` for each variable that differs, for a note to the learner."""

    def shown(env: dict[str, str], name: str) -> str:
        return repr(env[name]) if name in env else "unset"

    names = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return ", ".join(f"{k} ({shown(before, k)} -> {shown(after, k)})" for k in names)
