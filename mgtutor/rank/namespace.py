"""A rank's global namespace, and the rule for names the notebook's code reads.

The rule, the same for :meth:`mgtutor.Pool.run` and ``%%ddp``: **a rank's own names (what its
calls assign with ``global``, what ``%%ddp`` cells assign, what ``push`` sets) are never
replaced; any other name the code reads is the notebook's, as it is when the call is made.**
Where the notebook sent a value that the rank did not use because it has its own, the notebook
is told (:func:`kept_note`).
"""

from __future__ import annotations

import builtins
import sys
import types
from collections.abc import Callable
from typing import Any

from mgtutor.wire.pickling import PLAIN_TYPES


class _RankNamespace(dict):
    """A rank's global namespace: its own names, then the last notebook values sent to it.

    The dict itself holds only the rank's own names: what its calls assign with ``global``,
    what ``%%ddp`` cells assign, what ``push`` sets. A name the rank does not have is looked
    up among the notebook's values (:func:`take_notebook_values`), so those never replace a
    rank's own and need no bookkeeping of where each name came from.
    """

    def __missing__(self, name: str) -> Any:
        return _from_notebook[name]  # KeyError: the name is nowhere, a NameError for the code


_namespace: _RankNamespace = _RankNamespace(
    {"__name__": "__mgtutor_rank__", "__builtins__": builtins}
)
_from_notebook: dict[str, Any] = {}
_kept: list[str] = []  # notebook names this call did not use, the rank having its own


def namespace() -> dict[str, Any]:
    """The rank's global namespace, kept between a pool's calls (``%%ddp`` cells run in it)."""
    return _namespace


def begin_call() -> None:
    """Forget the names the last call kept (each call's are reported with it)."""
    _kept.clear()


def kept_names() -> list[str]:
    """The notebook names this call did not use because the rank has its own."""
    return list(_kept)


def take_notebook_values(values: dict[str, Any]) -> list[str]:
    """Offer this rank the notebook's values of the names a call reads (the pool's rule).

    A name the rank has of its own keeps the rank's value; every other name takes the
    notebook's, which stays visible to the rank's code until a call sends a newer one.

    Returns:
        The names whose notebook value was not used because the rank has its own (a module
        or a plain value equal to the rank's is not counted); the notebook says so.
    """
    for name, value in values.items():
        if name.startswith("__"):
            continue
        if name not in _namespace:
            _from_notebook[name] = value
        elif not _same(_namespace[name], value) and name not in _kept:
            _kept.append(name)
    return list(_kept)


def set_names(values: dict[str, Any]) -> None:
    """``Pool.push`` in the rank: the values become the rank's own names."""
    namespace().update(values)


def get_name(name: str) -> Any:
    """``Pool.pull`` in the rank: what the rank's code reads as ``name``."""
    space = namespace()
    try:
        return space[name]  # the rank's own, else the last notebook value sent to it
    except KeyError:
        known = sorted(k for k in space if not k.startswith("__"))
        raise NameError(
            f"this rank has no name {name!r}; it has: {', '.join(known) or 'none'}"
        ) from None


def take_cell_values(values: dict[str, Any]) -> None:
    """``%%ddp``'s way in: the notebook values a cell reads, its cell functions rebound."""
    take_notebook_values(values)
    for value in values.values():
        if isinstance(value, types.FunctionType):
            in_rank_namespace(value)  # offers what it reads, rebinds it among the values


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, PLAIN_TYPES) and a == b)


def in_rank_namespace(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn rebound to the rank's namespace, offered the notebook values it was pickled with.

    cloudpickle sends a cell's function with the globals it uses, as the notebook had them, in
    a dict shared by every cell function of the same call; here they are offered to the rank
    (:func:`take_notebook_values`: the rank's own names win), and every cell function among
    them is rebound to the rank's namespace, so a helper fn calls reads the names fn reads.
    """
    if not isinstance(fn, types.FunctionType):
        return fn
    module = sys.modules.get(fn.__module__ or "")
    if module is not None and fn.__globals__ is getattr(module, "__dict__", None):
        return fn  # a function of an importable module: its module is its namespace
    sent = fn.__globals__
    take_notebook_values(sent)
    memo: dict[int, types.FunctionType] = {}
    for name, value in list(_from_notebook.items()):
        if isinstance(value, types.FunctionType) and value.__globals__ is sent:
            _from_notebook[name] = _rebound(value, sent, memo)
    return _rebound(fn, sent, memo)


def _rebound(
    fn: types.FunctionType, sent: dict[str, Any], memo: dict[int, types.FunctionType]
) -> types.FunctionType:
    """fn with the rank's namespace as its globals; cell functions in its closure too."""
    if id(fn) in memo:
        return memo[id(fn)]
    cells = None
    if fn.__closure__ is not None:
        cells = tuple(types.CellType() for _ in fn.__closure__)
    rebound = types.FunctionType(fn.__code__, _namespace, fn.__name__, fn.__defaults__, cells)
    memo[id(fn)] = rebound
    for old, new in zip(fn.__closure__ or (), cells or ()):
        try:
            value = old.cell_contents
        except ValueError:
            continue  # an empty cell (a name not yet assigned where fn was made)
        dynamic = isinstance(value, types.FunctionType) and value.__globals__ is sent
        new.cell_contents = _rebound(value, sent, memo) if dynamic else value
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__dict__.update(fn.__dict__)
    rebound.__qualname__ = fn.__qualname__
    rebound.__module__ = fn.__module__
    return rebound


def kept_note(names: list[str], where: str = "this rank") -> str:
    """What a learner should know when the notebook's values of ``names`` were not used."""
    quoted = ", ".join(f"`{n}`" for n in names)
    verb = "was" if len(names) == 1 else "were"
    return (
        f"the notebook's {quoted} {verb} not used on {where}: a name a rank made (in an "
        f"earlier call, a %%ddp cell or by push) is never replaced by the notebook's"
    )
