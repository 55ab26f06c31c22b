"""A checker's result reads well as text and as HTML."""

from __future__ import annotations

from mgtutor.exercises import CheckResult


def test_results_read_well_as_text_and_html() -> None:
    result = CheckResult("f", "failed", "Case 'x', rank 1: wrong <b>.", hint="look.", cases=("x",))
    assert repr(result) == "f: FAILED\n  Case 'x', rank 1: wrong <b>.\n  Hint: look."
    assert "&lt;b&gt;" in result._repr_html_() and "<li>x</li>" in result._repr_html_()
    assert not result.passed and CheckResult("f", "passed", "ok").passed
