"""Per-rank progress bars in the notebook, as the ranks report with :func:`mgtutor.progress`.

In JupyterLab the launching cell shows an ipywidgets bar per rank that advances while the ranks
run, and a line with each rank's last count when they finish (a stored notebook, opened before
it runs or on a code host, shows the bars as a line of text and then that count); elsewhere (a
terminal, a script, a notebook without ipywidgets) the parent prints a plain line at every tenth
of the way. ``launch(..., quiet=True)`` and ``pool.run(..., quiet=True)`` show no progress at
all. The rank's side, :func:`mgtutor.rank.progress.progress`, sends the counts.
"""

from __future__ import annotations

from typing import Any

from mgtutor.rank.progress import print_text

__all__ = ["ProgressBoard", "display_widget"]


def display_widget(widget: Any, text: str) -> None:
    """Display ``widget`` with ``text`` as its plain-text form, and its first drawing if it has one.

    A notebook stores a display's text/plain as it was when shown, and shows it wherever the
    widget cannot be drawn: on a code host, in an untrusted notebook opened before it runs, in
    nbconvert's HTML. ipywidgets' own is the widget's repr (``VBox(children=(HBox(...``); this
    line says what the widget is instead. A widget that already holds a figure when shown (an
    Output widget inside it, filled before the display, as notebook 17's planner draws its first
    layout) stores that figure too, as the display's image/png: those places show the drawing,
    while a running notebook draws the live widget.
    """
    from IPython.display import display

    bundle = widget._repr_mimebundle_()
    bundle["text/plain"] = text
    image = _first_image(widget)
    if image is not None:
        bundle["image/png"] = image
    display(bundle, raw=True)


def _first_image(widget: Any) -> str | None:
    """The first PNG (base64, as stored) an Output widget in ``widget``'s tree holds, or None."""
    for output in getattr(widget, "outputs", ()):
        png = output.get("data", {}).get("image/png")
        if png:
            return png
    for child in getattr(widget, "children", ()):
        png = _first_image(child)
        if png is not None:
            return png
    return None


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class ProgressBoard:
    """The parent's view of every rank's progress: widgets in a notebook, text elsewhere."""

    def __init__(self, world_size: int, quiet: bool = False) -> None:
        self.world_size = world_size
        self.quiet = quiet
        self._bars: list[Any] | None = None
        self._labels: list[Any] = []
        self._text_tenths: dict[tuple[int, str], int] = {}
        self._widgets_usable: bool | None = None  # looked up at the first update, not per call

    @property
    def _use_widgets(self) -> bool:
        if self._widgets_usable is None:
            self._widgets_usable = in_notebook()
            if self._widgets_usable:
                try:
                    import ipywidgets  # noqa: F401
                except ImportError:
                    self._widgets_usable = False
        return self._widgets_usable

    def _make_widgets(self) -> None:
        import ipywidgets as widgets

        self._bars = []
        rows = []
        for rank in range(self.world_size):
            bar = widgets.IntProgress(
                value=0,
                min=0,
                max=1,
                description=f"rank {rank}",
                layout=widgets.Layout(width="55%"),
            )
            label = widgets.Label(value="")
            self._bars.append(bar)
            self._labels.append(label)
            rows.append(widgets.HBox([bar, label]))
        last = self.world_size - 1
        ranks = "rank 0" if last == 0 else f"ranks 0-{last}"
        display_widget(
            widgets.VBox(rows),
            f"[progress bars of {ranks}: drawn while a notebook runs; each rank's last count "
            f"is printed when the ranks finish]",
        )

    def update(self, rank: int, step: int, total: int, desc: str) -> None:
        """Show that ``rank`` has done ``step`` of ``total``."""
        if self.quiet:
            return
        if not self._use_widgets:
            key = (rank, desc)
            self._text_tenths[key] = print_text(rank, step, total, desc, self._text_tenths.get(key))
            return
        if self._bars is None:
            self._make_widgets()
        assert self._bars is not None
        bar = self._bars[rank]
        bar.max = total
        bar.value = min(step, total)
        label = f"{desc} " if desc else ""
        self._labels[rank].value = f"{label}{step}/{total} ({100 * step / total:.0f}%)"

    def finish(self, failed_rank: int | None) -> None:
        """Colour the bars (green when the launch succeeded, red on the rank that failed) and
        print each rank's last count, the bars' lasting text form."""
        if self._bars is None:
            return
        for rank, bar in enumerate(self._bars):
            if failed_rank is None:
                bar.bar_style = "success"
            elif rank == failed_rank:
                bar.bar_style = "danger"
                self._labels[rank].value += " - failed"
            else:
                bar.bar_style = "warning"
                self._labels[rank].value += " - stopped"
        counts = [
            f"rank {r} {label.value.lstrip(' -')}"
            for r, label in enumerate(self._labels)
            if label.value
        ]
        print("progress: " + ", ".join(counts), flush=True)
