"""What a rank says when fn's result cannot travel back to the notebook.

A rank pickles what fn returned (:func:`mgtutor.wire.pickling.dumps_on_cpu`) and sends it over a
pipe. A generator, a lock, an open file or a socket cannot be pickled, and the error pickle raises
names only a type, from deep inside cloudpickle. :func:`why_unsendable` says instead which value
it is (``result["it"]``, a generator), where fn returned it (its ``return`` line, the cell line
for a function defined in a notebook cell), and what to return instead.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import textwrap
from typing import Any

from mgtutor.errors import in_mgtutor
from mgtutor.wire.pickling import fails, type_name

__all__ = ["why_unsendable"]

_MAX_DEPTH = 8
_ADVICE = (
    "The result travels back to the notebook pickled: return plain data (tensors on the CPU, "
    "numbers, strings, lists, dicts, or objects made of them). Turn a generator into a list; "
    "keep locks, open files and sockets inside the rank."
)


def why_unsendable(fn: Any, result: Any, exc: BaseException) -> tuple[str, str]:
    """Say what in ``result`` cannot be pickled, and where fn returned it.

    Args:
        fn: the function the rank ran.
        result: what it returned.
        exc: the error pickling ``result`` raised.

    Returns:
        The message (which value, of which type, what to return instead) and the text that
        stands in for the rank's traceback: fn's ``return`` line(s), or "" where none is found.
    """
    path, value = _culprit(result, "result", 0)
    kind = type_name(value)
    what = f"fn returned a {kind}" if path == "result" else f"{path} is a {kind}"
    message = f"{what}, which cannot be pickled ({exc}). {_ADVICE}"
    return message, _return_lines(fn)


def _culprit(value: Any, path: str, depth: int) -> tuple[str, Any]:
    """The innermost part of ``value`` that cannot be pickled, and its path from the result."""
    if depth >= _MAX_DEPTH:
        return path, value
    parts: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        parts = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        parts = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, (set, frozenset)):
        parts = [(f"an element of {path}", v) for v in value]
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        parts = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    for part, inner in parts:
        if fails(inner):
            return _culprit(inner, part, depth + 1)
    return path, value


def _return_lines(fn: Any) -> str:
    """``fn returned it at cell line 5, in work:`` and that line; "" for mgtutor's own fn."""
    from mgtutor.doctor.reading import where

    fn = inspect.unwrap(fn.func if isinstance(fn, functools.partial) else fn)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return ""
    if in_mgtutor(code.co_filename):
        return ""  # pool.pull and the like: the learner's value, not a return line of theirs
    lines = _returns(code)
    if not lines:
        return ""
    shown = []
    for line in lines:
        place = where({"filename": code.co_filename, "line": line, "name": code.co_name})
        source = linecache.getline(code.co_filename, line).strip()
        shown.append(f"{place}:" + (f"\n    {source}" if source else ""))
    verb = "returned it at" if len(shown) == 1 else "returns at"
    return f"fn {verb} " + "\nor ".join(shown)


def _returns(code: Any) -> list[int]:
    """The lines of the ``return <value>`` statements of ``code``'s own body (a lambda's line).

    Returns of a constant are left out: they are never the value that could not be pickled.
    """
    if code.co_name == "<lambda>":
        return [code.co_firstlineno]
    try:
        source, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(source)))
    except (OSError, TypeError, SyntaxError):
        return []
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return []
    found: list[int] = []
    todo: list[ast.AST] = list(defs[0].body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue  # a nested function's returns are not fn's
        if isinstance(node, ast.Return) and not isinstance(node.value, (ast.Constant, type(None))):
            found.append(first + node.lineno - 1)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found)
