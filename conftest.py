"""pytest set-up shared by the unit tests and the notebooks run under nbval."""

from __future__ import annotations

import pytest

UNIT_TEST_TIMEOUT_S = 90


def pytest_collectstart(collector: pytest.Collector) -> None:
    # Warnings and progress text go to stderr and differ between machines: never compare them.
    if hasattr(collector, "skip_compare") and "stderr" not in collector.skip_compare:
        collector.skip_compare = (*collector.skip_compare, "stderr")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Unit tests get a tight limit so a hang fails fast; notebook cells keep nbval's own.
    for item in items:
        if item.path.suffix == ".py" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TEST_TIMEOUT_S))


@pytest.fixture(params=["forkserver", "spawn"])
def start_method(request, monkeypatch) -> str:
    """Run a launcher test once per start method: mgtutor.launch's default is set to each."""
    import importlib

    launch_module = importlib.import_module("mgtutor.launch")
    monkeypatch.setattr(launch_module, "DEFAULT_START_METHOD", request.param)
    return request.param
