"""Experiment: controls set the arguments, run() calls the experiment and keeps its result."""

from __future__ import annotations

import ipywidgets as widgets
import pytest

import mgtutor


def test_run_uses_the_controls_current_values() -> None:
    calls = []

    def experiment(world_size, batch):
        calls.append((world_size, batch))
        return world_size * batch

    exp = mgtutor.Experiment(
        experiment,
        title="scaling",
        world_size=widgets.IntSlider(value=2, min=1, max=4),
        batch=widgets.Dropdown(options=[8, 32], value=8),
    )
    assert exp.run() == 16
    exp.controls["world_size"].value = 3
    exp.controls["batch"].value = 32
    assert exp.values == {"world_size": 3, "batch": 32}
    exp.button.click()  # what a learner's click does
    assert calls == [(2, 8), (3, 32)] and exp.result == 96
    assert exp.status.value == "done: world_size=3, batch=32" and not exp.button.disabled


@pytest.fixture(params=["plain Python", "IPython shell"])
def shell(request):
    """Run the test with and without an IPython shell (one exists in every notebook)."""
    if request.param == "plain Python":
        yield None
        return
    from IPython.core.interactiveshell import InteractiveShell

    had_one = InteractiveShell.initialized()
    yield InteractiveShell.instance()
    if not had_one:
        InteractiveShell.clear_instance()


def test_a_failing_run_is_shown_not_raised(shell) -> None:
    # In a notebook, ipywidgets' Output swallows an exception leaving it: caught inside it.
    def experiment(world_size):
        raise mgtutor.WorkerError("rank 1 raised ValueError: no", rank=1)

    exp = mgtutor.Experiment(experiment, world_size=widgets.IntSlider(value=2))
    assert exp.run() is None
    assert isinstance(exp.error, mgtutor.WorkerError)
    assert exp.status.value == "failed: WorkerError" and not exp.button.disabled


def test_bad_controls_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one control"):
        mgtutor.Experiment(lambda: None)
    with pytest.raises(TypeError, match="not a value widget"):
        mgtutor.Experiment(lambda go: None, go=widgets.Button())
