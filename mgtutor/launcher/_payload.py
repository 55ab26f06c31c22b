"""Reuse a call's pickled function when nothing it carries can have changed.

A pool pickles ``(fn, args, kwargs)`` by value at every call (:func:`._send.pickle_payload`),
because the globals fn reads must travel as the notebook has them *now*. That costs more than
the rest of a call: cloudpickle looks through every loaded module for the submodules of each
package fn uses, so a function that names ``torch`` took about 0.8 ms to pickle here (torch
2.14.1, cloudpickle 3.1.2), eight times a whole round trip over a pipe.

:class:`PayloadCache` keeps the bytes of the last few payloads under a *key* made of everything
cloudpickle reads to write them, and hands the same bytes back while the key is the same. A key
can only be made where each of those things is immutable or pickled by name:

* numbers, strings, bytes, None, and tuples of them, compared by type and value;
* modules, and functions or classes that cloudpickle pickles by reference (importable by
  name), compared by identity; the number of loaded modules is part of every key, since it
  decides which submodules cloudpickle lists;
* functions pickled by value (defined in a cell): their code, names, defaults, closure,
  attributes and the globals they read, each keyed by the same rules.

Anything else (a list, a dict, a tensor, a model, a class defined in a cell: things a cell
can change in place) leaves the payload without a key: it is pickled afresh at every call, as
before. ``tests/launcher/test_payload.py`` checks, for each kind of value, that a reused
payload is byte for byte what :func:`mgtutor.wire.pickling.dumps` writes now.
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mgtutor.launcher import _send
from mgtutor.wire.pickling import PLAIN_TYPES

__all__ = ["PayloadCache", "payload_key", "shared"]

_BY_REPR = (float, complex)  # -0.0 == 0.0 and nan != nan, but their bytes differ


class _NoKey(Exception):
    """Raised inside :func:`payload_key` at the first value that cannot be keyed."""


class PayloadCache:
    """The pickled payloads of the last ``size`` distinct calls, by :func:`payload_key`.

    Args:
        size: how many payloads to keep.

    Example:
        >>> cache = PayloadCache()
        >>> payload, reusable = cache.dumps(fn, (), {})  # pickled, and kept
        >>> cache.dumps(fn, (), {})[0] is payload  # nothing fn carries changed: the same bytes
        True
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, bytes] = OrderedDict()

    def dumps(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[bytes, bool]:
        """fn and its arguments pickled by value, reused when their key is unchanged.

        Returns:
            The payload, and whether it is made only of values that cannot change in place
            (a rank may then keep what it unpickled for the next identical payload).

        Raises:
            mgtutor.errors.PicklingError: as :func:`._send.pickle_payload`.
        """
        key = payload_key(fn, args, kwargs)
        if key is None:
            return _send.pickle_payload(fn, args, kwargs), False
        payload = self._entries.get(key)
        if payload is None:
            payload = _send.pickle_payload(fn, args, kwargs)
            self._entries[key] = payload
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return payload, True


def payload_key(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple | None:
    """A value equal for two calls only if cloudpickle would write the same bytes for both.

    None where some part cannot be keyed (see the module docstring). A key holds the objects
    it compares by identity, so their ids cannot be reused while it is kept.
    """
    rules = _Rules.of_cloudpickle()
    if rules is None:
        return None
    try:
        return (len(sys.modules), rules.key(fn), rules.key(args), rules.items_key(kwargs))
    except _NoKey:
        return None


class _Rules:
    """cloudpickle's own answers to what it pickles by name and which globals a code reads.

    Both are private functions of cloudpickle (3.0 to 3.1 at least); where a version has
    neither, :meth:`of_cloudpickle` gives None and nothing is reused.
    """

    def __init__(self, by_reference: Callable[[Any], bool], code_globals: Callable) -> None:
        self.by_reference = by_reference
        self.code_globals = code_globals
        self.seen: dict[int, int] = {}

    @classmethod
    def of_cloudpickle(cls) -> _Rules | None:
        import cloudpickle

        module = cloudpickle.cloudpickle
        by_reference = getattr(module, "_should_pickle_by_reference", None)
        code_globals = getattr(module, "_extract_code_globals", None)
        if by_reference is None or code_globals is None:
            return None
        return cls(by_reference, code_globals)

    def key(self, value: Any) -> Any:
        kind = type(value)
        if kind in PLAIN_TYPES:
            return (kind, repr(value) if kind in _BY_REPR else value)
        if kind is tuple:
            return (tuple, *(self.key(v) for v in value))
        if kind is types.ModuleType:
            if self.by_reference(value):
                return ("module", value)
            raise _NoKey
        if kind is types.BuiltinFunctionType:
            owner = value.__self__
            if owner is None or isinstance(owner, types.ModuleType):
                return ("builtin", value)  # pickled by its module and name
            raise _NoKey
        if kind is types.FunctionType or isinstance(value, type):
            try:
                named = self.by_reference(value)
            except Exception as exc:
                raise _NoKey from exc
            if named:
                return ("by name", value)
            if kind is types.FunctionType:
                return self.function_key(value)
        raise _NoKey

    def function_key(self, fn: types.FunctionType) -> tuple:
        """What cloudpickle writes of a function pickled by value (``_function_getstate``)."""
        if id(fn) in self.seen:
            return ("seen", self.seen[id(fn)])  # a function that reaches itself (recursion)
        self.seen[id(fn)] = len(self.seen)
        try:
            cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
        except ValueError as exc:
            raise _NoKey from exc  # an empty cell
        names = self.code_globals(fn.__code__)
        used = {name: fn.__globals__[name] for name in names if name in fn.__globals__}
        return (
            "function",
            fn.__code__,  # equal code objects may differ in these two, which cloudpickle writes
            fn.__code__.co_filename,
            getattr(fn.__code__, "co_qualname", None),  # Python 3.11 and later
            fn.__name__,
            fn.__qualname__,
            fn.__module__,
            self.key(fn.__doc__),
            self.items_key(fn.__annotations__),
            self.items_key(fn.__kwdefaults__ or {}),
            self.key(fn.__defaults__ or ()),
            self.key(cells),
            self.items_key(used),
            self.items_key(fn.__dict__),
        )

    def items_key(self, mapping: dict) -> tuple:
        if type(mapping) is not dict:
            raise _NoKey
        return tuple((name, self.key(value)) for name, value in mapping.items())


#: The cache every pool and launch of this process shares (a launch in a loop reuses it too).
shared = PayloadCache()
