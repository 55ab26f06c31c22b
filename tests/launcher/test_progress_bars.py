"""What the widgets leave in a stored notebook, and the quiet launches and pool calls.

A notebook stores each display's text/plain as it was when shown; that is what a learner sees
on a code host or in a notebook opened before it runs. These tests run the notebook's side in
this process with the widgets on (as in a kernel) and read what would be stored.
"""

from __future__ import annotations

import importlib

import pytest

import mgtutor
import mgtutor.launcher.magic

# The module, not the function mgtutor.progress that the package exports under its name.
progress_module = importlib.import_module("mgtutor.launcher.progress_bars")

ipywidgets = pytest.importorskip("ipywidgets")

RAW_REPRS = ("VBox(", "HBox(", "Tab(", "IntProgress(", "Output(")


@pytest.fixture
def shown(monkeypatch) -> list[dict]:
    """Widgets on, as in a kernel; every bundle displayed is collected instead of shown."""
    bundles: list[dict] = []

    def display(bundle, raw=False):
        assert raw, "a widget must be displayed with its own text form"
        bundles.append(bundle)

    monkeypatch.setattr(progress_module, "in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", display)
    return bundles


def counting(n: int = 5) -> str:
    import torch.distributed as dist

    for i in range(n):
        mgtutor.progress(i + 1, n, desc="steps")
    print("done on", dist.get_rank() if dist.is_initialized() else "a rank")
    return "ok"


def test_progress_bars_store_a_line_and_print_the_final_count(shown, capsys) -> None:
    run = mgtutor.launch(counting, world_size=2)
    assert run.results == ["ok", "ok"]
    assert len(shown) == 1, shown
    text = shown[0]["text/plain"]
    assert "application/vnd.jupyter.widget-view+json" in shown[0]
    assert text.startswith("[progress bars of ranks 0-1") and "last count" in text, text
    assert not any(r in text for r in RAW_REPRS), text
    out = capsys.readouterr().out
    assert "progress: rank 0 steps 5/5 (100%), rank 1 steps 5/5 (100%)" in out, out


def test_a_failed_launch_prints_which_rank_failed_and_which_were_stopped(shown, capsys) -> None:
    def fails_on_one():
        import torch.distributed as dist

        mgtutor.setup()
        mgtutor.progress(1, 4)
        if dist.get_rank() == 1:
            raise ValueError("bad batch")
        dist.barrier()

    with pytest.raises(mgtutor.WorkerError):
        mgtutor.launch(fails_on_one, world_size=2)
    out = capsys.readouterr().out
    assert "rank 1 1/4 (25%) - failed" in out and "rank 0 1/4 (25%) - stopped" in out, out


def test_quiet_launches_and_pool_calls_show_no_progress(shown, capsys) -> None:
    assert mgtutor.launch(counting, world_size=2, quiet=True).results == ["ok", "ok"]
    with mgtutor.Pool(world_size=2) as pool:
        assert pool.run(counting, 3, quiet=True).results == ["ok", "ok"]
        quiet_out = capsys.readouterr().out
        assert not shown, shown
        assert "progress:" not in quiet_out and "5/5" not in quiet_out, quiet_out
        assert "[rank 0] done on 0" in quiet_out and "[rank 1] done on 1" in quiet_out
        pool.run(counting, 3)  # not quiet: the bars come back
        assert len(shown) == 1 and "rank 1 steps 3/3 (100%)" in capsys.readouterr().out


def test_quiet_outside_a_notebook_prints_no_progress_lines(capsys) -> None:
    mgtutor.launch(counting, world_size=2, quiet=True)
    out = capsys.readouterr().out
    assert "steps:" not in out and "[rank 1] done on a rank" in out, out
    mgtutor.launch(counting, world_size=2)
    assert "[rank 1] steps: 5/5 (100%)" in capsys.readouterr().out


def test_experiment_stores_a_line_naming_its_controls(shown) -> None:
    exp = mgtutor.Experiment(
        lambda world_size, batch: None,
        title="scaling",
        world_size=ipywidgets.IntSlider(value=2, min=1, max=4),
        batch=ipywidgets.Dropdown(options=[8, 32], value=8),
    )
    exp._ipython_display_()
    text = shown[0]["text/plain"]
    assert text.startswith("[scaling: controls set to world_size=2, batch=8"), text
    assert not any(r in text for r in RAW_REPRS), text


def test_ddp_shows_each_ranks_output_once(shown, capsys) -> None:
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "mgtutor")
    cell = "import torch.distributed as dist\nprint('hi', dist.get_rank())\ndist.get_rank() * 10"
    try:
        shell.run_line_magic("ddp_start", "-n 2")
        out, err = capsys.readouterr()
        assert "mgtutor: starting 2 ranks for %%ddp" in out and "starting" not in err, err
        shell.run_cell_magic("ddp", "", cell)
        out = capsys.readouterr().out
        assert out.count("[rank 0] hi 0") == 1 and "[rank 1] Out: 10" in out, out
        assert not shown  # the tagged lines only: no tabs repeating them
        shell.run_cell_magic("ddp", "--tabs", cell)
        out = capsys.readouterr().out
        assert "hi" not in out and "Out:" not in out, out  # in the tabs only
        (bundle,) = shown
        text = bundle["text/plain"]
        assert text.startswith("[%%ddp --tabs: the output of ranks 0, 1"), text
        assert not any(r in text for r in RAW_REPRS), text
        from ipywidgets.widgets.widget import _instances

        tab = _instances[bundle["application/vnd.jupyter.widget-view+json"]["model_id"]]
        texts = ["".join(o["text"] for o in child.outputs) for child in tab.children]
        assert texts == ["hi 0\nOut: 0\n", "hi 1\nOut: 10\n"], texts
    finally:
        shell.run_line_magic("ddp_stop", "")


def test_stored_notebooks_show_no_raw_widget_repr_or_machine_paths() -> None:
    # What a learner sees on a code host, or in a notebook opened before it runs.
    import json
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            for output in cell.get("outputs", []):
                texts = [output.get("text", "")]
                texts += [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
                texts += output.get("traceback", [])
                text = "".join("".join(t) if isinstance(t, list) else t for t in texts)
                found += [f"{path.name} cell {i}: {bad}" for bad in (*RAW_REPRS, "/work", "/tmp")
                          if bad in text]  # fmt: skip
    assert not found, "\n".join(found)


def test_a_widget_holding_a_figure_stores_it_as_its_image(shown) -> None:
    # Notebook 17's planner: controls and an Output widget that holds the first drawing when the
    # widget is shown. The stored display carries that PNG for pages that cannot draw widgets.
    import base64

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from IPython.core.pylabtools import print_figure

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.bar([0, 1], [1, 2])
    png = base64.b64encode(print_figure(fig, "png")).decode()
    plt.close(fig)
    area = ipywidgets.Output()
    area.outputs = ({"output_type": "display_data", "data": {"image/png": png}, "metadata": {}},)
    text = "[controls and their drawing]"
    controls = ipywidgets.HBox([ipywidgets.IntSlider(), ipywidgets.Output()])
    progress_module.display_widget(ipywidgets.VBox([controls, area]), text)
    progress_module.display_widget(ipywidgets.VBox([controls, ipywidgets.Output()]), text)
    drawn, empty = shown
    assert drawn["image/png"] == png and drawn["text/plain"] == text
    assert "application/vnd.jupyter.widget-view+json" in drawn
    assert "image/png" not in empty and empty["text/plain"] == text
