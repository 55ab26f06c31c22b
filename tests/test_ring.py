"""The ring formula: the bytes one rank sends, with literal values worked by hand."""

from __future__ import annotations

import pytest

from mgtutor.ring import bytes_sent_on_ring


def test_an_all_reduce_sends_two_passes_of_n_minus_one_nths() -> None:
    assert bytes_sent_on_ring("all_reduce", 2, 1000) == 1000
    assert bytes_sent_on_ring("all_reduce", 4, 1000) == 1500
    assert bytes_sent_on_ring("all_reduce", 1, 1000) == 0


def test_gathers_scatters_and_broadcasts_send_one_pass() -> None:
    assert bytes_sent_on_ring("all_gather", 4, 1000) == 750
    assert bytes_sent_on_ring("reduce_scatter", 4, 1000) == 750
    assert bytes_sent_on_ring("all_to_all", 4, 1000) == 750
    assert bytes_sent_on_ring("broadcast", 4, 1000) == 750


def test_calls_and_every_scale_before_one_rounding_down() -> None:
    assert bytes_sent_on_ring("all_gather", 3, 1000) == 666  # 2000 / 3
    assert bytes_sent_on_ring("all_gather", 3, 1000, calls=3) == 2000  # not 3 * 666
    assert bytes_sent_on_ring("all_reduce", 4, 1000, calls=2, every=8) == 375  # 3000 / 8


def test_a_name_that_is_not_a_ring_collective_is_refused() -> None:
    with pytest.raises(ValueError, match="'send' is not a ring collective"):
        bytes_sent_on_ring("send", 2, 1000)
