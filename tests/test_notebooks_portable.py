"""The notebooks check behaviour, not one machine or one torch: what can be seen without running.

Each notebook runs on torch 2.11 to the newest, on any core count, with a GPU or none, on Linux
or macOS (issue 31). Running them is nbval's job (CI runs them on the oldest and the newest
torch); this file catches, in every code cell, what only holds on the machine that wrote it:
torch's source text or docstrings read as if they were behaviour, a Linux-only call, and, in
the cells whose output nbval compares, a figure of this machine.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CHECKED = "nbval-check-output"

# Anywhere in a code cell: what macOS lacks.
NEVER = {
    r"\bsched_getaffinity\b": "is Linux-only (mgtutor.hardware.usable_cores() falls back)",
    r"""(multiprocessing_context=|get_context\()["']fork""": "forks on macOS too, where it is "
    "unsafe (use mgtutor.build.this_build().loader_start_method)",
}
# Source text and docstrings change with every torch release: a cell may show mgtutor's own or
# the notebook's (a learner reads the code that runs), never torch's.
TEXT_READERS = "getsource", "__doc__"
# In a cell whose output nbval compares: a figure of this machine, which another one prints
# differently (its cores, its GPUs).
NOT_IN_CHECKED = {
    r"\busable_cores\(": "prints or depends on this machine's core count",
    r"\bcpu_count\(": "prints or depends on this machine's core count",
    r"\bdevice_count\(": "prints or depends on this machine's GPU count",
    r"\benough_gpus\(": "prints SKIPPED here and runs on a GPU machine",
    r"\bGPUS\b": "depends on this machine's GPU count",
    r"\btorchvision\b": "is absent from some builds (skip it visibly: build.needs_torchvision)",
    r"\.describe\(\)": "prints which build this is (torch, CUDA, NCCL, accelerator, OS)",
}


def _code_cells(path: Path) -> list[tuple[int, str, bool]]:
    cells = json.loads(path.read_text())["cells"]
    return [
        (index, "".join(cell["source"]), CHECKED in cell.get("metadata", {}).get("tags", []))
        for index, cell in enumerate(cells)
        if cell["cell_type"] == "code"
    ]


def _root(node: ast.AST) -> str | None:
    """The first name of an expression: `mgtutor` for `mgtutor.parallel.f(x).g`."""
    while not isinstance(node, ast.Name):
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return None
    return node.id


def _parse(source: str) -> ast.Module:
    # IPython's magics and shell escapes are not Python.
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return ast.parse("\n".join(lines))


def _own_names(cells: list[tuple[int, str, bool]]) -> set[str]:
    """mgtutor, what the notebook imports from it, and what the notebook defines."""
    own = {"mgtutor"}
    for _, source, _ in cells:
        for node in ast.walk(_parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mgtutor"):
                own.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                own.update(
                    alias.asname or alias.name
                    for alias in node.names
                    if alias.name.startswith("mgtutor")
                )
    return own


def _reads_foreign_text(tree: ast.Module, own: set[str]) -> list[str]:
    """getsource(...) or .__doc__ of anything but mgtutor's or the notebook's own code."""
    loops = {  # for name in (a, b): name stands for a and b
        node.target.id: node.iter
        for node in ast.walk(tree)
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name)
    }

    def is_own(node: ast.AST) -> bool:
        name = _root(node)
        if name in loops and isinstance(loops[name], (ast.Tuple, ast.List)):
            return all(is_own(element) for element in loops[name].elts)
        return name in own

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            called = node.func.attr if isinstance(node.func, ast.Attribute) else _root(node.func)
            if called == "getsource" and not is_own(node.args[0]):
                found.append("getsource")
        elif isinstance(node, ast.Attribute) and node.attr == "__doc__" and not is_own(node.value):
            found.append("__doc__")
    return found


def _findings(path: Path) -> list[str]:
    found = []
    cells = _code_cells(path)
    own = _own_names(cells)
    for index, source, checked in cells:
        kind = "checked cell" if checked else "cell"
        for reader in _reads_foreign_text(_parse(source), own):
            found.append(
                f"{path.name} {kind} {index}: {reader} of torch's code "
                "(its text changes with each release: cite it in prose, check what it does)"
            )
        rules = {**NEVER, **NOT_IN_CHECKED} if checked else NEVER
        for pattern, why in rules.items():
            if re.search(pattern, source):
                found.append(f"{path.name} {kind} {index}: {pattern!r} {why}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_depends_on_torchs_text_linux_or_this_machine(path: Path) -> None:
    assert not _findings(path), "\n".join(_findings(path))


def test_the_rules_catch_what_they_name(tmp_path: Path) -> None:
    cells = [
        {
            "cell_type": "code",
            "metadata": {},
            "source": ["import inspect, os\n", "s = inspect.getsource(nn.Linear)\n"],
        },
        {"cell_type": "code", "metadata": {}, "source": ["os.sched_getaffinity(0)"]},
        {"cell_type": "code", "metadata": {"tags": [CHECKED]}, "source": ["print(GPUS)"]},
        {"cell_type": "code", "metadata": {}, "source": ["print(GPUS)"]},  # not compared: fine
        {"cell_type": "code", "metadata": {}, "source": ["def f():\n", "    pass\n"]},
        # The notebook's own code and mgtutor's may be shown; torch's docstring may not.
        {
            "cell_type": "code",
            "metadata": {},
            "source": [
                "from mgtutor.parallel import syncbn\n",
                "for g in (f, syncbn.forward):\n",
                "    print(inspect.getsource(g), mgtutor.launch.__doc__)\n",
                "%time x = 1\n",
            ],
        },
        {
            "cell_type": "code",
            "metadata": {},
            "source": ["for g in (f, torch.nn.Linear):\n", "    print(inspect.getsource(g))"],
        },
        {"cell_type": "code", "metadata": {}, "source": ["torch.nn.Linear.__doc__"]},
        {
            "cell_type": "code",
            "metadata": {},
            "source": ["DataLoader(d, multiprocessing_context='fork')"],
        },
        {"cell_type": "code", "metadata": {"tags": [CHECKED]}, "source": ["import torchvision"]},
        {"cell_type": "code", "metadata": {}, "source": ["import torchvision"]},  # unchecked: fine
        {
            "cell_type": "code",
            "metadata": {"tags": [CHECKED]},
            "source": ["this_build().describe()"],
        },
    ]
    notebook = tmp_path / "scratch.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    found = _findings(notebook)
    assert [line.split(":")[0] for line in found] == [
        "scratch.ipynb cell 0",
        "scratch.ipynb cell 1",
        "scratch.ipynb checked cell 2",
        "scratch.ipynb cell 6",
        "scratch.ipynb cell 7",
        "scratch.ipynb cell 8",
        "scratch.ipynb checked cell 9",
        "scratch.ipynb checked cell 11",
    ]
