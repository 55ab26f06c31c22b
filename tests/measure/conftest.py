"""Figures the plot tests make are closed after each test.

mgtutor's plots leave their figure open in pyplot, as any pyplot figure, so that a notebook
shows it however the cell ends (mgtutor.measure.figure); here nothing shows them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    yield
    import sys

    if "matplotlib.pyplot" in sys.modules:  # only where a test drew: pyplot is slow to import
        sys.modules["matplotlib.pyplot"].close("all")
