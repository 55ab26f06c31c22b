"""mgtutor.grid: the rank grid by formula, with no process and no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mgtutor.grid
from mgtutor.grid import Layout
from mgtutor.parallel import layout as parallel_layout


def test_layout_counts_its_ranks_and_numbers_them_tp_first() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8 and Layout().world_size == 1
    assert layout.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinates(6) == {"dp": 1, "tp": 0, "pp": 1}
    for rank in range(layout.world_size):
        assert layout.rank_of(**layout.coordinates(rank)) == rank
    assert Layout(dp=3, tp=1).group_ranks("dp") == [[0, 1, 2]]
    assert Layout(dp=3, tp=1).group_ranks("tp") == [[0], [1], [2]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"dp": 0}, "dp"), ({"tp": -2}, "tp"), ({"pp": 1.5}, "pp"), ({"tp": True}, "tp")],
)
def test_layout_refuses_an_axis_that_is_not_a_positive_whole_number(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"Layout: {field}=.*pass {field}=1"):
        Layout(**kwargs)


def test_layout_refuses_coordinates_and_axes_outside_it() -> None:
    with pytest.raises(ValueError, match="rank 4 is outside"):
        Layout(dp=2, tp=2).coordinates(4)
    with pytest.raises(ValueError, match="tp coordinate 2"):
        Layout(dp=2, tp=2).rank_of(dp=0, tp=2, pp=0)
    with pytest.raises(ValueError, match="axis 'cp'"):
        Layout().group_ranks("cp")  # type: ignore[arg-type]


def test_the_parallel_layout_re_exports_the_same_layout() -> None:
    assert parallel_layout.Layout is Layout
    assert parallel_layout.AXES is mgtutor.grid.AXES


def test_the_grid_imports_only_the_standard_library() -> None:
    # The planner and the parallel pieces both import it: no torch, no process groups.
    tree = ast.parse(Path(mgtutor.grid.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "dataclasses", "typing"}
