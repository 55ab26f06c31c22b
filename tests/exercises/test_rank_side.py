"""Inside a rank: what the learner's function raised comes back with the learner's own frames."""

from __future__ import annotations

import pytest
import torch

from mgtutor.exercises import rank_side, solutions


def test_a_learners_traceback_starts_below_the_checkers_frames(monkeypatch) -> None:
    monkeypatch.setattr(rank_side.dist, "get_rank", lambda *args, **kwargs: 0)

    def learner(tensor):
        raise ValueError("wrong")

    with pytest.raises(rank_side.LearnerFailed) as info:
        rank_side.call_learner(3, "a case", learner, torch.zeros(2))
    failure = rank_side.LearnerFailed.parse(str(info.value))
    assert (failure.index, failure.case, failure.rank) == (3, "a case", 0)
    assert (failure.exc_type, failure.message) == ("ValueError", "wrong")
    assert "in learner" in failure.where and "call_learner" not in failure.where
    # The reference solutions stand in for the learner's functions: their frames are shown.
    with pytest.raises(rank_side.LearnerFailed) as info:
        rank_side.call_learner(0, "a case", solutions.ring_average, torch.zeros(2))
    assert "in ring_average" in info.value.where, info.value.where
