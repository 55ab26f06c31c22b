"""pytest set-up shared by the unit tests and the notebooks run under nbval."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

UNIT_TEST_TIMEOUT_S = 90


def pytest_collectstart(collector: pytest.Collector) -> None:
    # Warnings and progress text go to stderr and differ between machines: never compare them.
    if hasattr(collector, "skip_compare") and "stderr" not in collector.skip_compare:
        collector.skip_compare = (*collector.skip_compare, "stderr")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Unit tests get a tight limit so a hang fails fast; notebook cells keep nbval's own.
    for item in items:
        if item.path.suffix == ".py" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TEST_TIMEOUT_S))
    # Not run twice. The launcher tests run on the start method mgtutor uses here by default
    # (forkserver on Linux, spawn on macOS); MGTUTOR_TEST_START_METHODS=both adds the other one
    # (.ci/run's stage 2 does), except for tests marked any_start_method, whose behaviour does
    # not depend on how ranks start. A test that asserts what a notebook collected in this
    # session asserts too runs only where that notebook does not (.ci/run's stage 5).
    from mgtutor.build import rank_start_method

    own = rank_start_method()
    both = os.environ.get("MGTUTOR_TEST_START_METHODS", "").strip().lower() == "both"
    notebooks = {item.path.name for item in items if item.path.suffix == ".ipynb"}
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        method = callspec.params.get("start_method") if callspec else None
        repeats = item.get_closest_marker("repeats_notebook")
        other_method = method is not None and method != own
        if (other_method and (not both or item.get_closest_marker("any_start_method"))) or (
            repeats and repeats.args[0] in notebooks
        ):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    # Longest files first (each file's tests keep their order): under `-n 2 --dist loadfile`
    # a worker takes the next file when it is free, so a long file taken last leaves the other
    # worker idle at the end. The order only moves whole files; no test depends on another's.
    items.sort(key=lambda item: _LONGEST_FIRST.get(item.path.stem, len(_LONGEST_FIRST)))


# The files of the README's test command that took 8 s or more on this 2-core machine, longest
# first (the junit file of `pytest -n 2 --dist loadfile`, 2026-11-29: test_browser 119 s, notebook
# 09 90 s, ..., test_layout_pipeline 8 s). Files not named go after them, in pytest's order.
_LONGEST_FIRST = {
    name: i
    for i, name in enumerate(
        (
            "test_browser",
            "09_torchrun_multinode",
            "18_step_time",
            "00_setup",
            "02_ddp",
            "test_faults",
            "test_lifetime",
            "20_when_a_rank_dies",
            "19_low_communication",
            "test_pool",
            "07_compute_and_communication",
            "test_build",
            "14_context_parallel",
            "test_launch",
            "10_debugging",
            "06_input_pipeline",
            "13_tensor_parallel",
            "12_memory_and_sharding",
            "05_gradient_accumulation",
            "17_planning_layouts",
            "15_pipeline_parallelism",
            "test_join_race",
            "04_sync_batchnorm",
            "test_doctor",
            "test_elastic",
            "test_interrupted",
            "test_torchrun",
            "03_distributed_sampler",
            "01_data_parallel",
            "16_expert_parallel",
            "test_wrong_answers",
            "test_notebook_figures",
            "test_step_check",
            "08_scaling",
            "21_layouts_run",
            "11_live_ranks",
            "test_worker",
            "test_activation_plan",
            "test_layout_pipeline",
        )
    )
}


@pytest.fixture(autouse=True, scope="module")
def _gloo_in_unit_tests() -> Iterator[None]:
    """Unit tests build CPU tensors: on a machine with a GPU per rank, a launch that names no
    backend would join NCCL and fail in its first collective. MGTUTOR_BACKEND=gloo keeps them on
    gloo there too (as here), module-scoped fixtures' launches included. nbval's notebook cells
    take no fixtures: the notebooks choose for themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MGTUTOR_BACKEND", "gloo")
        yield


@pytest.fixture(autouse=True)
def _own_choice_in_gpu_tests(request, monkeypatch) -> None:
    """Tests marked ``gpu`` keep each rank's own choice (NCCL with a GPU per rank)."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv("MGTUTOR_BACKEND", raising=False)


@pytest.fixture(params=["forkserver", "spawn"])
def start_method(request, monkeypatch) -> str:
    """Run a launcher test once per start method: the launcher's default is set to each."""
    from mgtutor.build import rank_start_method
    from mgtutor.launcher import _arguments

    if request.param == "forkserver" and rank_start_method() != "forkserver":
        pytest.skip("mgtutor does not start ranks from a forkserver on this system (macOS)")
    monkeypatch.setattr(_arguments, "default_start_method", lambda: request.param)
    return request.param
