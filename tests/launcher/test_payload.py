"""A call's pickled function is reused only while every byte cloudpickle would write is the same.

For each kind of value a function can carry, the reused payload is compared byte for byte with
what would be sent now (``pickling.dumps``: cloudpickle, with each code's file name); each change
a notebook can make (a global rebound, a helper redefined, a default, a closure, the code
itself, a newly imported module) must give a new key; values a cell can change in place must
give none. At the end, ranks see the change.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import types

import cloudpickle
import pytest

import mgtutor
from mgtutor.launcher import _payload
from mgtutor.launcher._payload import PayloadCache, payload_key
from mgtutor.wire import pickling

STEP = 3
SCALE = -0.0
NAMES = ("a", "b")
TABLE = [1, 2]


def _helper(x):
    return x * STEP


def _plain():
    return None


def _uses_modules_and_helpers(x, y=(1, 2.5), *, z="z"):
    """A docstring."""
    return _helper(x) + math.sqrt(STEP) + len(os.path.join(*NAMES)) + SCALE


def _recursive(n):
    return 1 if n == 0 else n * _recursive(n - 1)


def _nested():
    def inner():
        return STEP + _helper(1)

    return inner()


def _annotated(x: int) -> collections.OrderedDict:
    return collections.OrderedDict(a=x)


def _closure_of(value):
    def closure():
        return value + STEP

    return closure


def _reads_a_list():
    return TABLE[0]


def _with_an_attribute():
    return None


_with_an_attribute.note = "kept"

KEYED = [
    (_plain, (), {}),
    (_uses_modules_and_helpers, (1,), {"y": (3, -0.0), "z": "w"}),
    (_recursive, (3,), {}),
    (_nested, (), {}),
    (_annotated, (2,), {}),
    (_closure_of(4), (), {}),
    (_with_an_attribute, (), {}),
    (os.path.join, ("a", "b"), {}),  # pickled by name
    (math.sqrt, (2.0,), {}),  # a builtin function
]


def _as_if_defined_in_a_cell(fn):
    """fn as cloudpickle sees a cell's function: of __main__, so pickled by value."""
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__module__ = "__main__"
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    return copy


@pytest.mark.parametrize("fn, args, kwargs", KEYED, ids=[f[0].__name__ for f in KEYED])
@pytest.mark.parametrize("by_value", [False, True], ids=["as imported", "as in a cell"])
def test_a_reused_payload_is_what_would_be_sent_now(fn, args, kwargs, by_value) -> None:
    if by_value and isinstance(fn, types.FunctionType) and fn.__module__ == __name__:
        fn = _as_if_defined_in_a_cell(fn)
    cache = PayloadCache()
    first, reusable = cache.dumps(fn, args, kwargs)
    again, _ = cache.dumps(fn, args, kwargs)
    assert reusable and payload_key(fn, args, kwargs) is not None
    assert again is first
    assert again == pickling.dumps((fn, args, kwargs))


def _key_of(fn, *args, **kwargs):
    return payload_key(_as_if_defined_in_a_cell(fn), args, kwargs)


def test_every_change_a_notebook_makes_changes_the_key(monkeypatch) -> None:
    fn = _as_if_defined_in_a_cell(_uses_modules_and_helpers)
    before = payload_key(fn, (1,), {})
    assert payload_key(_as_if_defined_in_a_cell(_uses_modules_and_helpers), (1,), {}) == before
    changes = {
        "a global rebound": lambda: monkeypatch.setattr(sys.modules[__name__], "STEP", 4),
        "0.0 for -0.0": lambda: monkeypatch.setattr(sys.modules[__name__], "SCALE", 0.0),
        "a helper redefined": lambda: monkeypatch.setattr(
            sys.modules[__name__], "_helper", _as_if_defined_in_a_cell(_helper)
        ),
        "a helper's global": lambda: monkeypatch.setattr(sys.modules[__name__], "NAMES", ("c",)),
        "a default": lambda: monkeypatch.setattr(fn, "__defaults__", ((1, 2.6),)),
        "a keyword default": lambda: monkeypatch.setattr(fn, "__kwdefaults__", {"z": "v"}),
        "the code": lambda: monkeypatch.setattr(fn, "__code__", _recursive.__code__),
        "the docstring": lambda: monkeypatch.setattr(fn, "__doc__", "Another."),
        "an attribute": lambda: monkeypatch.setattr(fn, "note", 1, raising=False),
        "a module imported": lambda: monkeypatch.setitem(sys.modules, "mgtutor_new_module", sys),
    }
    for what, change in changes.items():
        change()
        assert payload_key(fn, (1,), {}) != before, what
        monkeypatch.undo()
        assert payload_key(fn, (1,), {}) == before, what
    assert payload_key(fn, (2,), {}) != before  # the arguments
    assert payload_key(fn, (True,), {}) != payload_key(fn, (1,), {})  # equal, not the same
    assert payload_key(fn, (1,), {"z": "w"}) != before
    assert payload_key(_closure_of(1), (), {}) != payload_key(_closure_of(2), (), {})


def test_the_same_code_from_another_cell_is_another_payload() -> None:
    # Equal code objects compare equal even from two cells; cloudpickle writes each cell's name.
    code = _plain.__code__
    moved = code.replace(co_filename="<ipython-input-2-0>")
    assert moved == code  # what makes the file name part of the key necessary
    first = _as_if_defined_in_a_cell(_plain)
    second = _as_if_defined_in_a_cell(_plain)
    second.__code__ = moved
    assert payload_key(first, (), {}) != payload_key(second, (), {})


class _DefinedHere:
    pass


@pytest.mark.parametrize(
    "fn, args, kwargs",
    [
        (_reads_a_list, (), {}),  # a global list: a cell can change it in place
        (_plain, ([1],), {}),
        (_plain, (), {"d": {}}),
        (_plain, (_DefinedHere(),), {}),
        (_closure_of([1]), (), {}),
    ],
    ids=["global list", "list argument", "dict argument", "object argument", "list in closure"],
)
def test_what_a_cell_can_change_in_place_is_pickled_at_every_call(fn, args, kwargs) -> None:
    fn = _as_if_defined_in_a_cell(fn)
    assert payload_key(fn, args, kwargs) is None
    cache = PayloadCache()
    first, reusable = cache.dumps(fn, args, kwargs)
    again, _ = cache.dumps(fn, args, kwargs)
    assert not reusable and again is not first and again == first


def test_a_class_of_a_cell_and_a_module_pickled_by_value_have_no_key() -> None:
    cell_class = type("CellClass", (), {"__module__": "__main__"})
    assert payload_key(_plain, (cell_class,), {}) is None
    cloudpickle.register_pickle_by_value(collections)
    try:
        assert _key_of(_annotated, 1) is None
    finally:
        cloudpickle.unregister_pickle_by_value(collections)
    assert _key_of(_annotated, 1) is not None


def test_the_cache_keeps_the_last_payloads_only() -> None:
    cache = PayloadCache(size=2)
    payloads = [cache.dumps(_plain, (i,), {})[0] for i in range(3)]
    assert cache.dumps(_plain, (2,), {})[0] is payloads[2]
    assert cache.dumps(_plain, (0,), {})[0] is not payloads[0]  # pushed out by 1 and 2


def _count_unpickling():
    import cloudpickle

    global unpickled
    unpickled = 0
    real = cloudpickle.loads

    def counting(data, *args, **kwargs):
        global unpickled
        unpickled += 1
        return real(data, *args, **kwargs)

    cloudpickle.loads = counting


def _how_many_unpickled():
    return unpickled


def _step_now():
    return STEP


@pytest.mark.timeout(300)
def test_ranks_reuse_an_unchanged_payload_and_see_every_change(monkeypatch) -> None:
    step = _as_if_defined_in_a_cell(_step_now)
    with mgtutor.Pool(world_size=2, backend="gloo") as pool:
        pool.run(_count_unpickling)
        results = [pool.run(step).results for _ in range(3)]
        monkeypatch.setattr(sys.modules[__name__], "STEP", 10)
        results += [pool.run(step).results for _ in range(2)]
        assert results == [[3, 3]] * 3 + [[10, 10]] * 2
        # Each payload once per rank (STEP 3, then 10), then the counter's own call.
        assert pool.run(_how_many_unpickled).results == [3, 3]
        monkeypatch.setattr(
            _payload.shared, "dumps", lambda fn, a, k: (pickling.dumps((fn, a, k)), False)
        )
        pool.run(step)
        pool.run(step)
        assert pool.run(_how_many_unpickled).results == [6, 6]  # not reusable: every time
