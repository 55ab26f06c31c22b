"""The notebooks check behaviour, not one machine or one torch: what can be seen without running.

Each notebook runs on torch 2.11 to the newest, on any core count, with a GPU or none, on Linux
or macOS (issue 31). Running them is nbval's job (CI runs them on the oldest and the newest
torch); this file catches, in every code cell, what only holds on the machine that wrote it:
torch's source text or docstrings read as if they were behaviour, a Linux-only call, and, in
the cells whose output nbval compares, a figure of this machine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CHECKED = "nbval-check-output"

# Anywhere in a code cell: text that changes with every torch release, or that macOS lacks.
NEVER = {
    r"\bgetsource\(": "reads torch's source text (cite the file in prose; check what it does)",
    r"\.__doc__\b": "reads a docstring (cite it in prose; check what the code does)",
    r"\bsched_getaffinity\b": "is Linux-only (mgtutor.hardware.usable_cores() falls back)",
}
# In a cell whose output nbval compares: a figure of this machine, which another one prints
# differently (its cores, its GPUs).
NOT_IN_CHECKED = {
    r"\busable_cores\(": "prints or depends on this machine's core count",
    r"\bcpu_count\(": "prints or depends on this machine's core count",
    r"\bdevice_count\(": "prints or depends on this machine's GPU count",
    r"\benough_gpus\(": "prints SKIPPED here and runs on a GPU machine",
    r"\bGPUS\b": "depends on this machine's GPU count",
}


def _code_cells(path: Path) -> list[tuple[int, str, bool]]:
    cells = json.loads(path.read_text())["cells"]
    return [
        (index, "".join(cell["source"]), CHECKED in cell.get("metadata", {}).get("tags", []))
        for index, cell in enumerate(cells)
        if cell["cell_type"] == "code"
    ]


def _findings(path: Path) -> list[str]:
    found = []
    for index, source, checked in _code_cells(path):
        rules = {**NEVER, **NOT_IN_CHECKED} if checked else NEVER
        for pattern, why in rules.items():
            if re.search(pattern, source):
                kind = "checked cell" if checked else "cell"
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
            "source": ["import inspect, os\n", "s = inspect.getsource(f)\n"],
        },
        {"cell_type": "code", "metadata": {}, "source": ["os.sched_getaffinity(0)"]},
        {"cell_type": "code", "metadata": {"tags": [CHECKED]}, "source": ["print(GPUS)"]},
        {"cell_type": "code", "metadata": {}, "source": ["print(GPUS)"]},  # not compared: fine
    ]
    notebook = tmp_path / "scratch.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    found = _findings(notebook)
    assert [line.split(":")[0] for line in found] == [
        "scratch.ipynb cell 0",
        "scratch.ipynb cell 1",
        "scratch.ipynb checked cell 2",
    ]
