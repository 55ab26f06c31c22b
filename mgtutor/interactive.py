"""Controls that re-run an experiment: sliders and dropdowns, a Run button, the redrawn plot.

In JupyterLab a learner changes the world size or the batch with a slider, presses Run, and the
experiment launches again with those values and redraws its figure. The same object also runs
without a click (:meth:`Experiment.run`), which is how the notebooks' plain cells and the tests
exercise it::

    def timeline(world_size, batch):
        return mgtutor.plot_timeline(mgtutor.launch(train, batch, world_size=world_size))

    exp = mgtutor.Experiment(
        timeline,
        world_size=widgets.IntSlider(2, min=1, max=4, description="ranks"),
        batch=widgets.Dropdown(options=[8, 32, 128], value=32, description="batch"),
    )
    exp          # shows the controls, the Run button and the output area
    exp.run()    # runs once with the current values
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Experiment"]


class Experiment:
    """A parameterised experiment with widgets to set its arguments and a button to run it.

    Args:
        run: called with one keyword argument per control; whatever it returns (a matplotlib
            Figure, a Run, text) is displayed in the output area.
        title: a line shown above the controls.
        **controls: ipywidgets value widgets (IntSlider, Dropdown, Checkbox, ...), by the name
            of the argument of ``run`` they set.

    Attributes:
        result: what the last run returned (None before the first run or after a failure).
        error: the exception the last run raised, if any; it is shown in the output area rather
            than raised, because a button's callback has nowhere to raise to.
    """

    def __init__(self, run: Callable[..., Any], *, title: str = "", **controls: Any) -> None:
        import ipywidgets as widgets

        if not controls:
            raise ValueError(
                "an Experiment needs at least one control, e.g. world_size=IntSlider(...)"
            )
        for name, control in controls.items():
            if not hasattr(control, "value"):
                raise TypeError(
                    f"control {name!r} is a {type(control).__name__}, not a value widget"
                )
        self._run = run
        self.controls = controls
        self.result: Any = None
        self.error: BaseException | None = None
        self.button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.status = widgets.Label(value="")
        self.output = widgets.Output()
        self.button.on_click(lambda _: self.run())
        self.title = title
        header = [widgets.HTML(f"<b>{title}</b>")] if title else []
        self.widget = widgets.VBox(
            [*header, *controls.values(), widgets.HBox([self.button, self.status]), self.output]
        )

    @property
    def values(self) -> dict[str, Any]:
        """The arguments the next run will get, read from the controls."""
        return {name: control.value for name, control in self.controls.items()}

    def run(self) -> Any:
        """Run the experiment with the controls' current values and show what it returns."""
        from IPython.display import display

        values = self.values
        self.button.disabled = True
        self.status.value = "running with " + ", ".join(f"{k}={v}" for k, v in values.items())
        self.output.clear_output(wait=True)
        self.result, self.error = None, None
        # Caught inside the output area: in a notebook (an IPython shell exists) ipywidgets'
        # Output swallows an exception that leaves it, after showing its traceback.
        with self.output:
            try:
                self.result = self._run(**values)
                if self.result is not None:
                    display(self.result)
            except Exception as exc:  # shown to the learner; a click has no caller to raise to
                self.error = exc
                print(f"{type(exc).__name__}: {exc}")
            finally:
                self.button.disabled = False
        if self.error is None:
            self.status.value = "done: " + ", ".join(f"{k}={v}" for k, v in values.items())
        else:
            self.status.value = f"failed: {type(self.error).__name__}"
        return self.result

    def _ipython_display_(self) -> None:
        from mgtutor.launcher.progress_bars import display_widget

        settings = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        name = f"{self.title}: " if self.title else ""
        display_widget(
            self.widget,
            f"[{name}controls set to {settings} and a Run button, drawn while the notebook runs]",
        )
