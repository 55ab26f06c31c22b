"""What a checker answers: passed, failed or not attempted, shown as a box in Jupyter.

:func:`mgtutor.exercises.checking.check` makes one :class:`CheckResult` per check; a notebook
shows it through ``_repr_html_``, a terminal through ``repr``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = ["FAILED", "NOT_ATTEMPTED", "PASSED", "CheckResult", "Status"]

#: What a check can answer.
Status = Literal["passed", "failed", "not attempted"]
PASSED: Final = "passed"
FAILED: Final = "failed"
NOT_ATTEMPTED: Final = "not attempted"


@dataclass(frozen=True)
class CheckResult:
    """What a checker found: shown as a coloured box in Jupyter, as text elsewhere.

    Attributes:
        exercise: the name of the function checked (``"ring_average"``).
        status: ``"passed"``, ``"failed"`` or ``"not attempted"`` (the function is still the
            stub that raises ``NotImplementedError``).
        message: what happened: the cases passed, or the first case that failed and what came
            out there.
        hint: what to look at when it failed ("" otherwise).
        cases: the cases the checker runs.
        world_size: the number of ranks it ran on.
        reference: for ``"not attempted"``, the result of mgtutor's reference solution run
            through the same checks.
    """

    exercise: str
    status: Status
    message: str
    hint: str = ""
    cases: tuple[str, ...] = ()
    world_size: int = 2
    reference: CheckResult | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        """Whether the function passed every case."""
        return self.status == PASSED

    def __repr__(self) -> str:
        lines = [f"{self.exercise}: {self.status.upper()}", *_indent(self.message)]
        if self.hint:
            lines += _indent(f"Hint: {self.hint}")
        if self.reference is not None:
            lines += _indent(repr(self.reference))
        return "\n".join(lines)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        colour = {PASSED: "#2e7d32", FAILED: "#c62828"}.get(self.status, "#757575")
        parts = [
            f'<div style="border-left: 4px solid {colour}; padding: 2px 10px; margin: 4px 0">',
            f'<b style="color: {colour}">{html.escape(self.exercise)}: '
            f"{html.escape(self.status.upper())}</b>",
            f'<pre style="white-space: pre-wrap; margin: 4px 0">{html.escape(self.message)}</pre>',
        ]
        if self.hint:
            parts.append(f"<p><i>Hint:</i> {html.escape(self.hint)}</p>")
        if self.cases and self.reference is None:
            items = "".join(f"<li>{html.escape(case)}</li>" for case in self.cases)
            parts.append(
                "<details><summary>the cases"
                + (f", on {self.world_size} ranks" if self.world_size > 1 else "")
                + "</summary>"
                f"<ul>{items}</ul></details>"
            )
        if self.reference is not None:
            parts.append(self.reference._repr_html_())
        parts.append("</div>")
        return "".join(parts)


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]
