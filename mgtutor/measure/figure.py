"""The figure every mgtutor plot returns: drawn exactly once in a notebook, however it is shown.

A plain pyplot figure left as a cell's last value is drawn twice (by IPython's display hook and
by the inline backend when the cell ends); one closed early is never drawn by ``plt.show()`` or
when assigned. This figure stays open in pyplot until IPython displays it, so each of these
draws it once:

    mgtutor.plot_memory(run)                    # the cell's last value
    fig = mgtutor.plot_memory(run)              # assigned: the inline backend shows it
    mgtutor.plot_memory(run); plt.show()        # pyplot shows it
    display(mgtutor.plot_memory(run))           # shown here, not again at the cell's end

Outside IPython it is a plain matplotlib figure: ``fig.savefig(...)``, ``plt.show()``. This module
imports matplotlib, so it is imported only by the functions that draw (workers never pay for it).
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure as _MatplotlibFigure

__all__ = ["Figure", "new_figure"]


class Figure(_MatplotlibFigure):
    """A matplotlib Figure that pyplot forgets once IPython has displayed it.

    Named Figure, so that its text form is matplotlib's (``<Figure size 700x340 with 1 Axes>``).
    """

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> None:
        # IPython asks every object for a mime bundle before it renders its PNG. Returning None
        # leaves the rendering to the inline backend's formatter as for any figure; closing here
        # keeps the backend from drawing it a second time when the cell ends.
        plt.close(self)


def new_figure(width: float, height: float) -> Figure:
    """A new figure of ``width`` x ``height`` inches, with a constrained layout, open in pyplot.

    Made through pyplot, so that in a notebook the inline backend loads and shows it when the
    cell ends unless it was displayed before (see the module's docstring).
    """
    figure = plt.figure(figsize=(width, height), layout="constrained", FigureClass=Figure)
    assert isinstance(figure, Figure)  # FigureClass made it one; pyplot's stubs say the base
    return figure
