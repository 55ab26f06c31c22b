"""Every cell meant to draw shows its figure: in a running kernel, and in the stored notebooks.

A learner calls mgtutor's plots every way a notebook allows: as the cell's last value, assigned
to a variable, followed by ``plt.show()``, given to ``display``. Each must draw the figure once
(issue 34: ``plot_breakdown(...)`` then ``plt.show()`` drew nothing, and notebook 13 was stored
without the chart its next paragraph discusses). The first test runs those cells in a real
IPython kernel and counts the images each one sent; the second reads every stored notebook and
finds each cell that draws (it calls a mgtutor ``plot_*``, a pyplot drawing function, or a
function the notebook defines that does; or it is tagged ``figure``) and checks that it stored an
image. A cell that printed ``SKIPPED`` (a GPU demonstration on a machine without GPUs) draws
nothing by design.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import mgtutor

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
IMAGES = ("image/png", "image/svg+xml")
TAG = "figure"  # a cell that draws in a way the reading below cannot see

# pyplot's functions that make or show a figure (not its helpers: Rectangle, get_cmap, close).
PYPLOT_DRAWING = {
    "figure", "subplots", "subplot", "subplot_mosaic", "show", "plot", "bar", "barh",
    "scatter", "imshow", "matshow", "hist", "pie", "step", "stairs", "errorbar", "stackplot",
    "fill_between", "pcolormesh", "contour", "contourf", "broken_barh",
}  # fmt: skip
# mgtutor's plots, called by their bare names after `from mgtutor import plot_memory`.
MGTUTOR_PLOTS = {n for n in mgtutor.__all__ if n.startswith("plot_")} | {"plot_bandwidth"}


# --- in a kernel: each way of showing a plot draws it once ----------------------------------

KERNEL_SETUP = """\
import matplotlib.pyplot as plt
from IPython.display import display

import mgtutor
from mgtutor.bench import BandwidthPoint, BandwidthResult, plot_bandwidth
from mgtutor.plan.memplan import MemoryBreakdown
from mgtutor.measure.memory import MemoryStats
from mgtutor.launcher.run import RankResult, Run
from mgtutor.measure.timing import PhaseRecord

def rank(r):
    memory = MemoryStats(device="cpu", rss_at_start=2**20, peak_rss=2**21)
    timings = [PhaseRecord("forward", s, s, s + 0.5) for s in range(3)]
    timings += [PhaseRecord("step", s, s, s + 1.0, samples=8) for s in range(3)]
    return RankResult(r, 1000 + r, "cpu", "gloo", 1.0, memory, r, timings)

run = Run(2, [rank(0), rank(1)], 3.0)
one = Run(1, [rank(0)], 3.0)
parts = [MemoryBreakdown(parameters=10, gradients=10, optimizer_state=20, communication=0)]
sweep = BandwidthResult([BandwidthPoint(1024, 1e-4, 1e7, 1e7)], 2, "gloo", "cpu", 1e9, 1024)
"""

# The ways a cell shows a plot, each with the images it must send: one per figure.
SHOWN = {
    "last value": ("mgtutor.plot_breakdown(parts)", 1),
    "plot_breakdown": ('fig = mgtutor.plot_breakdown(parts, title="t")', 1),
    "assigned": ("fig = mgtutor.plot_breakdown(parts)", 1),
    "plt.show()": ("mgtutor.plot_breakdown(parts)\nplt.show()", 1),
    "assigned, plt.show()": ("fig = mgtutor.plot_breakdown(parts)\nplt.show()", 1),
    "a trailing ;": ("mgtutor.plot_breakdown(parts);", 1),
    "display() mid-cell": ("display(mgtutor.plot_breakdown(parts))\nx = 1", 1),
    "assigned, then last": ("fig = mgtutor.plot_breakdown(parts)\nfig.axes[0].set_ylim(0)\nfig", 1),
    "display(), then plt.show()": ("display(mgtutor.plot_breakdown(parts))\nplt.show()", 1),
    "two assigned": ("a = mgtutor.plot_breakdown(parts)\nb = mgtutor.plot_breakdown(parts)", 2),
    # Every plot the package has, assigned (the way that drew nothing before).
    "plot_memory": ("fig = mgtutor.plot_memory(run)", 1),
    "plot_timeline": ("fig = mgtutor.plot_timeline(run)", 1),
    "plot_step_times": ("fig = mgtutor.plot_step_times(run)", 1),
    "plot_scaling": ("fig = mgtutor.plot_scaling([one, run])", 1),
    "plot_bandwidth": ("fig = plot_bandwidth(sweep)", 1),
    "nothing drawn": ("x = 2", 0),
}


def test_each_way_of_showing_a_plot_draws_it_once() -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    assert set(SHOWN) >= MGTUTOR_PLOTS, f"add a case for {sorted(MGTUTOR_PLOTS - set(SHOWN))}"
    cells = [KERNEL_SETUP] + [source for source, _ in SHOWN.values()]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    # The kernel inherits PYTHONPATH, so it imports this checkout's mgtutor.
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    drawn = {
        way: sum(any(m in o.get("data", {}) for m in IMAGES) for o in cell.outputs)
        for way, cell in zip(SHOWN, nb.cells[1:])
    }
    wanted = {way: images for way, (_, images) in SHOWN.items()}
    assert drawn == wanted, {way: (drawn[way], wanted[way]) for way in SHOWN}


# --- in the stored notebooks: every cell that draws stored an image --------------------------


def _tree(source: str) -> ast.Module | None:
    """A cell's code as Python: IPython's line magics and shell lines blanked, cell magics None."""
    if source.lstrip().startswith("%%"):
        return None
    lines = [
        ("pass" if line.lstrip().startswith(("%", "!")) else line) for line in source.split("\n")
    ]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _called(node: ast.Call) -> tuple[str, str]:
    """(owner, name) of what a call calls: ("plt", "show"), ("", "redraw"), ("mgtutor", ...)."""
    func = node.func
    if isinstance(func, ast.Name):
        return "", func.id
    if isinstance(func, ast.Attribute):
        owner = func.value
        while isinstance(owner, ast.Attribute):  # mgtutor.bench.plot_bandwidth: "mgtutor"
            owner = owner.value
        return (owner.id if isinstance(owner, ast.Name) else ""), func.attr
    return "", ""


def _calls(body: list[ast.stmt], *, into_functions: bool) -> list[ast.Call]:
    """The calls in these statements; those inside def/lambda/class only when asked."""
    found: list[ast.Call] = []
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if not into_functions and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
        ):
            continue
        if isinstance(node, ast.Call):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _draws(call: ast.Call, drawing_functions: set[str]) -> bool:
    owner, name = _called(call)
    if owner == "mgtutor":  # mgtutor.plot_memory(...), mgtutor.bench.plot_bandwidth(...)
        return name.startswith("plot_")
    if owner == "plt":
        return name in PYPLOT_DRAWING
    return not owner and (name in drawing_functions or name in MGTUTOR_PLOTS)


def cells_meant_to_draw(nb: dict) -> list[tuple[int, dict]]:
    """(code cell number as nbval counts them, cell) for each cell that draws when it runs."""
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    trees = [_tree("".join(c["source"])) for c in code]
    definitions = {
        node.name: node
        for tree in trees
        if tree
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    drawing: set[str] = set()  # functions the notebook defines that draw, however deep
    while True:
        more = {
            name
            for name, node in definitions.items()
            if name not in drawing
            and any(_draws(c, drawing) for c in _calls(node.body, into_functions=False))
        }
        if not more:
            break
        drawing |= more
    return [
        (i, cell)
        for i, (cell, tree) in enumerate(zip(code, trees))
        if TAG in cell.get("metadata", {}).get("tags", [])
        or tree
        and any(_draws(c, drawing) for c in _calls(tree.body, into_functions=False))
    ]


def _stored_images(cell: dict) -> int:
    return sum(any(m in o.get("data", {}) for m in IMAGES) for o in cell.get("outputs", []))


def _skipped(cell: dict) -> bool:
    text = "".join(
        "".join(o.get("text", "")) for o in cell.get("outputs", []) if o["output_type"] == "stream"
    )
    return re.search(r"^SKIPPED\b", text, re.MULTILINE) is not None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_that_draws_stored_its_figure(path: Path) -> None:
    nb = json.loads(path.read_text(encoding="utf-8"))
    missing = [
        f"code cell {i} ({''.join(cell['source']).strip().splitlines()[0][:70]!r})"
        for i, cell in cells_meant_to_draw(nb)
        if not _stored_images(cell) and not _skipped(cell)
    ]
    assert not missing, (
        f"{path.name}: these cells draw but stored no figure (code cells counted from 0, as "
        f"nbval does): {missing}. Re-execute the notebook and store it with its outputs."
    )


def test_the_reading_finds_what_draws() -> None:
    # The reading itself, on cells whose answer is known: each way a cell can draw, and cells
    # that only define or pass on a function that draws.
    cells = {
        "mgtutor.plot_memory(run)": True,
        "fig = mgtutor.bench.plot_bandwidth(result)": True,
        "fig, ax = plt.subplots()\nax.plot([1])": True,
        "if ok:\n    show_it(x)": True,  # show_it, defined below, draws
        "def show_it(x):\n    helper(x)": False,  # defines only
        "def helper(x):\n    plt.show()": False,
        "explore = mgtutor.Experiment(show_it, k=1)": False,  # passed on, drawn on a click
        "plt.close(fig)\nhandles = [plt.Rectangle((0, 0), 1, 1)]": False,
        "%%ddp\nplt.show()": False,
        "%matplotlib inline\nmgtutor.plot_timeline(run)": True,
        "from mgtutor import plot_memory\nplot_memory(run)": True,
        "def plot_shards(s):\n    return s\nplot_shards(1)": False,  # named plot_, draws not
    }
    nb = {"cells": [{"cell_type": "code", "source": s, "metadata": {}} for s in cells]}
    tagged = {"cell_type": "code", "source": "draw_somehow()", "metadata": {"tags": [TAG]}}
    nb["cells"].append(tagged)
    found = {i for i, _ in cells_meant_to_draw(nb)}
    wanted = {i for i, draws in enumerate(cells.values()) if draws} | {len(cells)}
    assert found == wanted, (sorted(found), sorted(wanted))
    skipped = {"outputs": [{"output_type": "stream", "text": "SKIPPED: needs 2 GPUs\n"}]}
    assert _skipped(skipped) and not _skipped({"outputs": []})
