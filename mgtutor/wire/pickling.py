"""How values cross the pipe between the notebook and a rank, in both directions.

Both sides pickle with cloudpickle, *by value* (a function defined in a notebook cell has no
module a rank could import), except that code keeps the name of its file (:func:`dumps`), so a
rank's traceback can show the cell's lines. A rank sends fn's result back with every tensor on
the CPU (:func:`dumps_on_cpu`), so the notebook never initializes CUDA to read it.
"""

from __future__ import annotations

import functools
import marshal
import pickle
import sys
import types
from collections import ChainMap
from typing import Any

__all__ = ["PLAIN_TYPES", "dumps", "dumps_on_cpu", "fails", "pickler", "type_name"]

#: Values that hold no other object: compared by value, pickled as they are, never changed in
#: place (the namespace rule, the payload's key and a rank's result use them alike).
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)


def dumps(value: Any) -> bytes:
    """``cloudpickle.dumps(value)``, except that code keeps the name of its file.

    cloudpickle 3.1.3 writes every code object's file as ``"<dynamic-code>"`` (to make its
    bytes the same wherever a function was defined); a rank's traceback then names no file and
    shows no line of the cell or test that raised. Here a code object travels as ``marshal``
    writes it, file name included: the ranks run this same interpreter, so they read it back.
    """
    import io

    buffer = io.BytesIO()
    pickler()(buffer).dump(value)
    return buffer.getvalue()


def _code_reduce(code: types.CodeType) -> tuple:
    try:
        return marshal.loads, (marshal.dumps(code),)
    except ValueError:  # a constant marshal cannot write (only code built by hand has one)
        return _cloudpickle_code_reduce(code)


def _cloudpickle_code_reduce(code: types.CodeType) -> tuple:
    import cloudpickle

    return cloudpickle.Pickler.dispatch_table[types.CodeType](code)


@functools.cache
def pickler() -> Any:
    """cloudpickle's pickler with :func:`_code_reduce` for code (made once: 20 us a class)."""
    import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap(
            {types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table
        )

    return _Pickler


def type_name(value: Any) -> str:
    """A value's type as a learner would write it: ``int``, ``torch.Tensor``."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def fails(value: Any) -> bool:
    """Whether :func:`dumps` cannot pickle ``value``."""
    try:
        dumps(value)
        return False
    except Exception:
        return True


def dumps_on_cpu(result: Any) -> bytes:
    """Pickle fn's result with every tensor moved to the CPU.

    A CUDA tensor pickled as it is would be rebuilt on ``cuda:r`` in the notebook, which
    initializes CUDA in the kernel (or fails on a machine without that GPU).
    """
    if type(result) in PLAIN_TYPES:
        return pickle.dumps(result, protocol=pickle.DEFAULT_PROTOCOL)  # 1 us, not 8
    import io

    buffer = io.BytesIO()
    _cpupickler()(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(result)
    return buffer.getvalue()


@functools.cache
def _cpupickler() -> Any:
    """The pickler class of :func:`dumps_on_cpu`, made once (a class per call cost 20 us)."""

    class _CpuPickler(pickler()):  # type: ignore[misc]  # a base chosen at run time
        def reducer_override(self, obj: Any) -> Any:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                return obj.detach().cpu().__reduce_ex__(self.proto)
            return super().reducer_override(obj)

    return _CpuPickler
