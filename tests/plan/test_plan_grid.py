"""plan(layout=): the planner takes the Layout the ranks run on, and a plan keeps it."""

from __future__ import annotations

import pytest

from mgtutor.grid import Layout
from mgtutor.plan.planner import layouts, plan
from mgtutor.plan.shape import Transformer

GB = 10**9
MODEL = Transformer(layers=4, hidden=64, heads=4, seq_len=32, micro_batch=2, vocab=100)


def test_a_layout_plans_the_same_as_its_three_sizes_and_the_plan_keeps_it() -> None:
    grid = Layout(dp=2, tp=2, pp=2)
    by_layout = plan(MODEL, 8, GB, layout=grid, micro_batches=2)
    assert by_layout == plan(MODEL, 8, GB, dp=2, tp=2, pp=2, micro_batches=2)
    assert by_layout.grid == grid
    assert by_layout.layout == "dp=2 x tp=2 x pp=2"  # the label the notebooks print, unchanged
    assert plan(MODEL, 8, GB, tp=2).grid == Layout(dp=4, tp=2)


def test_every_plan_of_layouts_keeps_a_grid_of_its_gpus() -> None:
    found = layouts(MODEL, 4, GB, micro_batches=4)
    assert found and all(p.grid.world_size == 4 for p in found)
    assert {(p.grid.dp, p.grid.tp, p.grid.pp) for p in found} >= {(4, 1, 1), (2, 2, 1)}


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"tp": 1}, {"pp": 2}])
def test_a_layout_with_dp_tp_or_pp_as_well_is_refused(sizes) -> None:
    with pytest.raises(ValueError, match=r"got layout=Layout\(dp=2, tp=2, pp=1\).*pass one"):
        plan(MODEL, 4, GB, layout=Layout(dp=2, tp=2), **sizes)


def test_a_layout_of_another_size_than_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs dp\*tp\*pp = 4 GPUs, got gpus=8: pass gpus=4"):
        plan(MODEL, 8, GB, layout=Layout(dp=2, tp=2))


@pytest.mark.parametrize(
    ("sizes", "named"), [({"tp": 0}, "tp=0"), ({"dp": -2, "tp": -4}, "dp=-2"), ({"pp": 0}, "pp=0")]
)
def test_a_size_below_1_is_refused_by_name(sizes, named) -> None:
    with pytest.raises(ValueError, match=rf"{named} must be a whole number of ranks"):
        plan(MODEL, 8, GB, **sizes)


def test_no_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gpus=0; pass the number of GPUs"):
        plan(MODEL, 0, GB)


def test_sizes_that_do_not_multiply_to_gpus_are_still_refused() -> None:
    with pytest.raises(ValueError, match=r"dp x tp x pp must equal gpus \(8\)"):
        plan(MODEL, 8, GB, dp=3, tp=2)
    with pytest.raises(ValueError, match="micro_batches must be 1 or more"):
        plan(MODEL, 2, GB, micro_batches=0)
