"""What travels to the ranks with each call: the function, its arguments, the cells' text.

A function defined in a notebook cell cannot be pickled by name (the ranks have no such
module), so it is pickled *by value* with cloudpickle, with the globals it uses; the text of the
notebook's cells goes along, so that a rank's traceback can show the cell's lines; and the
notebook's environment, of which some variables act only when a process group is made.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import types
from collections.abc import Callable, Collection
from typing import Any

from mgtutor.errors import PicklingError
from mgtutor.wire.messages import Context
from mgtutor.wire.pickling import dumps, fails, type_name

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
    """fn and its arguments pickled by value for the ranks.

    Raises:
        mgtutor.errors.PicklingError: something cannot be pickled; the message names the
            variable or argument that holds it.
    """
    try:
        return dumps((fn, args, kwargs))
    except Exception as exc:
        culprit = _unsendable(fn, args, kwargs) or "fn (or something it uses)"
        raise PicklingError(
            f"mgtutor could not send {culprit} to the ranks: {exc}. Each rank is a new process "
            f"and gets a pickled copy of fn, its arguments and the globals it uses; create "
            f"objects such as locks, open files, sockets or generators inside the function "
            f"instead of passing them in."
        ) from exc


def _unsendable(fn: Any, args: tuple, kwargs: dict) -> str | None:
    """Name what cannot be pickled: an argument, or a variable fn (or a function it calls) uses."""
    import inspect

    try:
        names = list(inspect.signature(fn).bind_partial(*args).arguments)
    except (TypeError, ValueError):
        names = []
    for i, value in enumerate(args):
        if fails(value):
            name = f"`{names[i]}` " if i < len(names) else ""
            return f"argument {i} {name}(a {type_name(value)})"
    for key, value in kwargs.items():
        if fails(value):
            return f"keyword argument `{key}` (a {type_name(value)})"
    return _in_function(fn, set())


def _in_function(fn: Any, seen: set[int]) -> str | None:
    """The closure variable, global or default of fn that cannot be pickled, named."""

    if isinstance(fn, functools.partial):
        return _unsendable(fn.func, fn.args, fn.keywords)
    if isinstance(fn, types.MethodType):
        if fails(fn.__self__):
            owner = f"the object method {fn.__func__.__qualname__} is bound to"
            return f"`self` ({owner}, a {type_name(fn.__self__)})"
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType) or id(fn) in seen:
        return None
    seen.add(id(fn))
    code = fn.__code__
    used: list[tuple[str, str, Any]] = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            used.append((name, "closure variable", cell.cell_contents))
        except ValueError:
            continue  # an empty cell: nothing to send
    for name in _global_names(code):
        if name in fn.__globals__:
            used.append((name, "global", fn.__globals__[name]))
    defaults = _defaults(fn)
    used += [(name, "default", value) for name, value in defaults.items()]
    for name, kind, value in used:
        if not fails(value):
            continue
        deeper = _in_function(value, seen)
        if deeper is not None:
            return deeper
        return f"`{name}` (a {kind} of {fn.__qualname__}, a {type_name(value)})"
    return None


def _defaults(fn: Any) -> dict[str, Any]:
    """fn's default argument values by parameter name."""
    code = fn.__code__
    values = fn.__defaults__ or ()
    positional = code.co_varnames[: code.co_argcount]
    found = dict(zip(positional[len(positional) - len(values) :], values))
    found.update(fn.__kwdefaults__ or {})
    return found


def _global_names(code: Any) -> list[str]:
    """The global names a code object (and the functions and classes nested in it) may read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names += _global_names(const)
    return list(dict.fromkeys(names))


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
