"""``%%ddp``: run a notebook cell on every rank of a live pool, each rank with its own namespace.

Load it with ``%load_ext mgtutor``. Then::

    %ddp_start -n 2 --backend gloo      # optional: the first %%ddp starts 2 ranks itself

    %%ddp
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Linear(4, 1))   # stays on each rank for the next cells

    %%ddp --ranks 1
    model.module.weight                  # rank 1's value, shown as [rank 1] Out: ...

    %ddp_stop

Each cell's code runs in the rank's namespace (not the notebook's), under the same rule as
:meth:`mgtutor.Pool.run`: the rank's own names (what its cells assign, what ``%ddp_push`` sets)
are never replaced; any other name the cell reads is the notebook's, as it is when the cell
runs (the notebook says so where it has a value that a rank did not use because it has its
own). ``%ddp_push lr model`` gives every rank the notebook's values. What a cell prints comes
back as ``[rank r] ...`` lines, and the value of its last line, if it is an expression, as
``[rank r] Out: ...`` (its ``repr``, so any object can be shown). The last cell's
:class:`mgtutor.Run` is in the notebook as ``_ddp``. ``%%ddp --tabs`` shows each rank's output
in a tab of its own instead (in a running JupyterLab; a stored notebook keeps only a line saying
so, so the tagged lines are the default).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import shlex
import symtable
from typing import Any

from mgtutor.errors import ArgumentError
from mgtutor.launcher._report import Wording
from mgtutor.launcher.pool import Pool

__all__ = ["load_ipython_extension", "current_pool"]

_state: dict[str, Any] = {"pool": None, "options": {"world_size": 2, "backend": None}, "cells": 0}

_CELL_HELP = """\
%%ddp [--ranks R[,R...]] [--timeout S] [--tabs]

Run this cell's code on every rank of the notebook's pool (started with 2 ranks on first use,
or as %ddp_start says), in each rank's own namespace, kept across cells. A name the cell
reads comes from the rank if the rank has it (made by an earlier cell or %ddp_push), from the
notebook otherwise; the notebook says when one of its values was not used for that reason.
%ddp_push NAME [NAME...] gives every rank the notebook's values of these names.

  --ranks 0,2    run on these ranks only. A collective (all_reduce, barrier, a DDP forward or
                 backward) needs every rank of the process group: if only some ranks enter one
                 they wait for the others, until --timeout passes; then every rank is stopped
                 and the pool starts new ones on the next cell (what the ranks held is lost).
  --timeout S    stop the cell after S seconds once every rank started it (default: no limit).
  --tabs         show each rank's output in a tab of its own instead of [rank r] lines
                 (JupyterLab with ipywidgets; a stored notebook keeps only a line saying so).

An exception on one rank is reported with that rank's traceback. If the other ranks finish the
cell, the pool is kept; if they wait for the failed rank in a collective, every rank is stopped
and the next cell starts new ones. Ctrl+C (interrupt the kernel) interrupts the cell on every
rank; ranks blocked in a collective cannot be interrupted and are stopped instead, and the error
says which rank the others waited for and where each was.
"""


_DDP_WORDING = Wording(
    work="The %%ddp cell",
    owner="the %%ddp ranks",
    note="The %%ddp ranks were stopped; the next %%ddp cell starts new ones (what they held is "
    "lost).",
    push="%ddp_push {names}",
    kept="The %%ddp ranks",
    sent="the cell",
)


def current_pool() -> Pool | None:
    """The pool that ``%%ddp`` cells run on, if one was started."""
    return _state["pool"]


def _pool() -> Pool:
    pool = _state["pool"]
    if pool is None or pool.closed:
        options = _state["options"]
        print(
            f"mgtutor: starting {options['world_size']} ranks for %%ddp "
            f"(backend {options['backend'] or 'chosen by setup'}); %ddp_stop ends them.",
            flush=True,
        )
        backend = f" --backend {options['backend']}" if options["backend"] else ""
        wording = dataclasses.replace(
            _DDP_WORDING, restart=f"%ddp_start -n {options['world_size']}{backend}"
        )
        pool = Pool(options["world_size"], options["backend"], _wording=wording)
        _state["pool"] = pool
    return pool


def _run_source(source: str, filename: str, values: bytes) -> str | None:
    """Inside a rank: run a cell's code in the rank's namespace; the last expression's repr.

    ``values`` are the notebook's values of the names the cell reads, pickled once in the
    notebook (:func:`_notebook_values`); the rank's own names win over them (the pool's
    namespace rule, :mod:`mgtutor.rank.namespace`).
    """
    import pickle

    from mgtutor.rank.namespace import namespace, take_cell_values

    take_cell_values(pickle.loads(values))
    space = namespace()
    tree = ast.parse(source, filename)
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, filename, "exec"), space)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), space)
    return None if value is None else repr(value)


def names_read(source: str) -> set[str]:
    """The global names a cell's code reads and does not itself assign at its top level.

    Those are the names a rank looks up elsewhere: its own namespace, then the notebook's.
    A name the cell assigns (``x = ...``, ``def x``, ``import x``) is the cell's own.
    """
    try:
        top = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()  # the rank reports the error, with the cell's line
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                read.add(symbol.get_name())
    return read - bound


def _notebook_values(source: str, user_ns: dict[str, Any]) -> bytes:
    """The notebook's values of the names a cell reads, less those that cannot travel, pickled.

    Pickled here, once: trying is how a value that cannot travel is found, and the bytes then
    travel as they are.
    """
    from mgtutor.launcher._send import dumps

    hidden = {"In", "Out", "get_ipython", "exit", "quit"}
    values = {
        name: user_ns[name]
        for name in sorted(names_read(source))
        if name in user_ns and name not in hidden and not name.startswith("_")
    }
    try:
        return dumps(values)
    except Exception:
        pass
    sendable = {}
    for name, value in values.items():
        try:
            dumps(value)
            sendable[name] = value
        except Exception as exc:
            print(
                f"mgtutor: %%ddp did not send the notebook's `{name}` to the ranks: it cannot "
                f"be pickled ({type(exc).__name__}: {exc}). The ranks use their own `{name}` "
                f"if they have one; build it in a %%ddp cell otherwise.",
                flush=True,
            )
    return dumps(sendable)


def _parse_ranks(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ArgumentError(
            f"--ranks takes rank numbers separated by commas, got {text!r}"
        ) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentError(f"{self.prog}: {message}. See %{self.prog}? for the options.")


def _cell_parser() -> _Parser:
    parser = _Parser(prog="%ddp", add_help=False)
    parser.add_argument("--ranks", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--tabs", action="store_true")
    return parser


def _start_parser() -> _Parser:
    parser = _Parser(prog="ddp_start", add_help=False)
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    return parser


def _rank_tabs(world_size: int, ranks: list[int]) -> tuple[Any, dict[int, Any]] | None:
    """A Tab with one Output per rank, or None where ipywidgets cannot be shown."""
    from mgtutor.launcher.progress_bars import in_notebook

    if not in_notebook():
        return None
    try:
        import ipywidgets as widgets
    except ImportError:
        return None
    outputs = {r: widgets.Output() for r in ranks}
    tab = widgets.Tab(children=[outputs[r] for r in ranks])
    for i, r in enumerate(ranks):
        tab.set_title(i, f"rank {r}")
    return tab, outputs


def _tabs_text(ranks: list[int]) -> str:
    """The tabs' plain-text form: what a stored notebook shows in their place."""
    return (
        f"[%%ddp --tabs: the output of rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}, a tab each, drawn while the notebook runs; "
        f"without --tabs it is printed as [rank r] lines]"
    )


def ddp(line: str, cell: str) -> Any:
    """The ``%%ddp`` cell magic (see the module docstring and ``%%ddp?``)."""
    options = _cell_parser().parse_args(shlex.split(line))
    chosen = None if options.ranks is None else _parse_ranks(options.ranks)
    pool = _pool()
    ranks = chosen if chosen is not None else list(range(pool.world_size))
    _state["cells"] += 1
    filename = f"<ddp-cell-{_state['cells']}>"
    import linecache

    # The notebook's linecache carries the cell's text to the ranks (for their tracebacks).
    lines = cell.splitlines(keepends=True)
    linecache.cache[filename] = (len(cell), None, lines, filename)
    tabs = _rank_tabs(pool.world_size, ranks) if options.tabs else None
    if tabs is not None:
        from mgtutor.launcher.progress_bars import display_widget

        tab, outputs = tabs
        display_widget(tab, _tabs_text(ranks))
        # The tabs replace the tagged lines: each rank's output is shown once.
        pool.output_sink = lambda rank, stream, text: _to_tab(outputs, rank, stream, text)
    values = _notebook_values(cell, _user_namespace())
    try:
        run = pool.run(_run_source, cell, filename, values, ranks=ranks, timeout=options.timeout)
    finally:
        pool.output_sink = None
    for r, value in zip(ranks, run.results):
        if value is None:
            continue
        if tabs is None:
            print(f"[rank {r}] Out: {value}")
        else:
            _to_tab(tabs[1], r, "stdout", f"Out: {value}")
    _user_namespace()["_ddp"] = run
    return None


def _user_namespace() -> dict[str, Any]:
    """The notebook's namespace (an empty dict outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return shell.user_ns if shell is not None else {}


def _to_tab(outputs: dict[int, Any], rank: int, stream: str, text: str) -> None:
    out = outputs.get(rank)
    if out is None:
        return
    if stream == "stdout":
        out.append_stdout(text + "\n")
    else:
        out.append_stderr(text + "\n")


def ddp_start(line: str) -> None:
    """``%ddp_start -n N --backend B``: (re)start the pool %%ddp cells run on."""
    options = _start_parser().parse_args(shlex.split(line))
    ddp_stop("")
    _state["options"] = {"world_size": options.world_size, "backend": options.backend}
    _pool()


def ddp_push(line: str) -> None:
    """``%ddp_push lr model``: give every rank the notebook's values of these names.

    Pushed names become each rank's own, as with :meth:`mgtutor.Pool.push`: they replace what
    the ranks had, and later cells read them even where the notebook changes its own.
    """
    names = line.split()
    space = _user_namespace()
    missing = [n for n in names if n not in space]
    if not names or missing:
        raise ArgumentError(
            f"%ddp_push takes names the notebook has, e.g. %ddp_push lr model; "
            f"{'the notebook has no ' + ', '.join(missing) if missing else 'no names given'}"
        )
    _pool().push(**{n: space[n] for n in names})


def ddp_stop(line: str) -> None:
    """``%ddp_stop``: end the ranks of the %%ddp pool (each leaves the process group first)."""
    pool = _state["pool"]
    _state["pool"] = None
    if pool is not None:
        pool.close()


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%ddp``, ``%ddp_start``, ``%ddp_push``, ``%ddp_stop`` (``%load_ext mgtutor``)."""
    ddp.__doc__ = _CELL_HELP
    ipython.register_magic_function(ddp, "cell", "ddp")
    ipython.register_magic_function(ddp_start, "line", "ddp_start")
    ipython.register_magic_function(ddp_push, "line", "ddp_push")
    ipython.register_magic_function(ddp_stop, "line", "ddp_stop")
