"""Every notebook within the reading budget: under 60 cells, at most 2,200 words of prose.

Words are the whitespace-separated tokens of the markdown cells (a table's ``|`` counts as one).
The limits are the project's (DEVELOPERS.md); the third budget, two minutes per notebook under
nbval on a 2-core machine, is a property of the machine and is not tested here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MAX_WORDS = 2200
MAX_CELLS = 59


def prose_words(notebook: Path) -> int:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum(
        len(re.findall(r"\S+", "".join(cell["source"])))
        for cell in cells
        if cell["cell_type"] == "markdown"
    )


def test_the_notebooks_are_found() -> None:
    assert len(NOTEBOOKS) >= 18, [n.name for n in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda n: n.stem)
def test_notebook_within_reading_budget(notebook: Path) -> None:
    words = prose_words(notebook)
    cells = len(json.loads(notebook.read_text(encoding="utf-8"))["cells"])
    assert words <= MAX_WORDS, (
        f"{notebook.name} has {words} words of prose, over {MAX_WORDS}: cut words, not claims "
        "(repetition, restated outputs, provenance into the Sources list at the end)"
    )
    assert cells <= MAX_CELLS, f"{notebook.name} has {cells} cells, over {MAX_CELLS}: merge or cut"
