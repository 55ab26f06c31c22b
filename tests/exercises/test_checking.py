"""What every checker shares: a stub, a function that raises, one that hangs, a bad argument."""

from __future__ import annotations

import pytest
import torch

from mgtutor import exercises
from mgtutor.build import torch_release
from mgtutor.errors import WorkerTimeout
from mgtutor.exercises import checking as _checking
from mgtutor.exercises import solutions
from tests.exercises import wrong_answers as w

# The checkers serve the notebooks, which run on the newest torch only: not run on the floor.
needs_notebook_torch = pytest.mark.skipif(
    torch_release() < (2, 6),
    reason=f"the exercises run with the notebooks' torch (>= 2.6), not {torch.__version__}",
)


def _failed_with(result: exercises.CheckResult, *words: str) -> bool:
    text = f"{result.message} {result.hint}".lower()
    return result.status == "failed" and all(w.lower() in text for w in words)


@needs_notebook_torch
def test_a_stub_is_not_attempted_and_shows_the_reference_passing() -> None:
    def exact_accuracy(correct, sampler):
        """Your answer."""
        raise NotImplementedError  # your code here

    result = exercises.check_exact_accuracy(exact_accuracy)
    assert result.status == "not attempted" and not result.passed
    assert result.reference is not None and result.reference.passed
    assert "NOT ATTEMPTED" in repr(result) and "PASSED" in repr(result)
    assert "not attempted" in result._repr_html_().lower()


@needs_notebook_torch
def test_a_function_that_raises_is_reported_with_its_rank_and_traceback() -> None:
    (result,) = exercises._check("exact_accuracy", [(w.accuracy_raises_on_rank_1,)])
    assert _failed_with(result, "rank 1 raised ValueError: no samples here"), result
    assert 'raise ValueError("no samples here")' in result.message


@needs_notebook_torch
def test_a_function_that_hangs_is_stopped_and_reported() -> None:
    (result,) = exercises._check(
        "exact_accuracy", [(w.accuracy_waits_for_a_message_never_sent,)], timeout=2
    )
    assert _failed_with(result, "did not finish within 2 s", "every rank"), result
    # Where each rank waited is shown from the learner's own function down.
    assert "in accuracy_waits_for_a_message_never_sent" in result.message, result.message
    assert "Rank 0 was not in your function" not in result.message, result.message


def test_a_checker_shows_the_learners_frames_innermost_last() -> None:
    stack = "\n".join(
        [
            f'  File "{_checking._CALL_FILE}", line 20, in call_learner',
            "    return fn(tensor)",
            '  File "/notebook/cell.py", line 9, in ring_average',
            "    dist.recv(buf, src)",
            '  File "/torch/distributed/distributed_c10d.py", line 2600, in recv',
            "    work.wait()",
        ]
    )
    error = WorkerTimeout("hung", running=[0], stacks={0: stack})
    exercise = _checking.Exercise(
        key="ring",
        name="ring_average",
        functions=("ring_average",),
        world_size=2,
        cases=("one",),
        run=lambda payload, index, folder: [],
        reference=(solutions.ring_average,),
        hang_hint="send and recv must pair up",
    )
    shown = _checking._hung("check_ring_average", exercise, error, 5.0).message
    lines = shown.splitlines()
    where = lines.index("Where rank 0 was waiting (most recent call last):")
    assert "ring_average" in lines[where + 1] and "in recv" in lines[where + 3], lines
    assert "call_learner" not in shown.split("most recent call last")[1], shown


def test_stubs_are_recognized_without_running() -> None:
    def stub(x):
        raise NotImplementedError  # your code here

    def documented_stub(x):
        """Docstring."""
        raise NotImplementedError("write me")

    def started(x):
        print(x)
        raise NotImplementedError

    assert _checking._is_stub(stub) and _checking._is_stub(documented_stub)
    assert not _checking._is_stub(started) and not _checking._is_stub(solutions.ring_average)
    with pytest.raises(TypeError, match="pass the function itself"):
        exercises.check_ring_average(None)
