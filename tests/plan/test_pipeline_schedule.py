"""pipeline_schedule: the played schedule against the bubble formulas, and sends."""

from __future__ import annotations

import pytest

from mgtutor.plan.pipeline_schedule import order, simulate


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 9), (8, 16)])
def test_1f1b_and_gpipe_without_sends_give_narayanans_bubble(p, m):
    for schedule in ("1F1B", "GPipe"):
        end = max(simulate([1.0] * p, [2.0] * p, m, schedule=schedule))
        assert end == pytest.approx((m + p - 1) * 3.0)  # bubble (p-1)/(m+p-1)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (8, 8, 2), (4, 8, 4)])
def test_interleaving_divides_the_bubble_by_the_chunks(p, m, v):
    end = max(simulate([1.0] * p, [2.0] * p, m, chunks=v, schedule="interleaved"))
    assert (end - 3.0 * m) / end == pytest.approx((p - 1) / (v * m + p - 1))


def test_1f1b_keeps_at_most_p_micro_batches_in_flight():
    for stage in range(4):
        live = peak = 0
        for kind, _, _ in order(stage, 4, 8):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - stage


def test_sends_cost_less_than_two_per_micro_batch_and_more_than_the_fill():
    # d on each transfer: the wire overlaps other micro-batches' work in the steady state.
    p, m, d = 4, 8, 1.0
    still = max(simulate([1.0] * p, [2.0] * p, m))
    sent = max(simulate([1.0] * p, [2.0] * p, m, d))
    assert 2 * (p - 1) * d < sent - still < 2 * (m + p - 1) * d
    assert sent - still == pytest.approx(2 * d * ((p - 1) * m / p + p - 2))  # here, exactly


def test_the_last_stage_s_extra_work_sets_the_pace():
    even = max(simulate([1.0] * 4, [2.0] * 4, 16))
    heavy = max(simulate([1.0, 1.0, 1.0, 1.5], [2.0, 2.0, 2.0, 3.0], 16))
    assert heavy - even == pytest.approx(16 * 1.5, rel=0.1)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        order(0, 4, 6, 2, "interleaved")
    with pytest.raises(ValueError, match="one chunk"):
        order(0, 4, 8, 2, "1F1B")
    with pytest.raises(ValueError, match="schedule must be"):
        order(0, 4, 8, 1, "zero-bubble")
