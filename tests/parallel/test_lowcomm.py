"""mgtutor.parallel.lowcomm: one averaging all-reduce, the ring's bytes, and the slow link's delay.

One launch of 2 gloo ranks (cached) runs every distributed check; the tests read its results.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mgtutor
from mgtutor.parallel.comms import record_comms
from mgtutor.parallel.lowcomm import average_, ring_sent_bytes, slow_allreduce_hook

DELAY = 2e-4  # seconds per byte: 800 bytes sent cost 0.16 s


def _ranks() -> dict[str, Any]:
    mgtutor.setup()
    rank = dist.get_rank()
    tensors = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 * rank)]
    with record_comms() as calls:
        nbytes = average_(tensors)
    start = time.perf_counter()
    average_([torch.zeros(200)], seconds_per_byte=DELAY)  # 800 bytes, all sent on 2 ranks
    slow = time.perf_counter() - start
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    model.register_comm_hook(None, slow_allreduce_hook(0.0))
    model(torch.full((2, 4), float(rank + 1))).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {
        "tensors": tensors,
        "calls": [(c.op, c.buffer) for c in calls],
        "nbytes": nbytes,
        "slow": slow,
        "grads": grads,
    }


@functools.cache
def _results() -> list[dict[str, Any]]:
    return mgtutor.launch(_ranks, world_size=2, backend="gloo", quiet=True).results


def test_ring_sent_bytes() -> None:
    assert ring_sent_bytes(1000, 2) == 1000
    assert ring_sent_bytes(1000, 4) == 1500
    assert ring_sent_bytes(1000, 1) == 0


@pytest.mark.timeout(120)
def test_average_is_the_mean_in_one_all_reduce() -> None:
    for result in _results():
        first, second = result["tensors"]
        assert torch.equal(first, torch.full((3,), 0.5))
        assert torch.equal(second, torch.full((2, 2), 5.0))
        assert result["calls"] == [("all_reduce", 7 * 4)]
        assert result["nbytes"] == 7 * 4


@pytest.mark.timeout(120)
def test_the_slow_link_sleeps_its_bytes() -> None:
    for result in _results():
        assert result["slow"] >= 800 * DELAY


@pytest.mark.timeout(120)
def test_the_hook_averages_like_ddp() -> None:
    # Rank r's input is all (r + 1): the averaged weight gradient is 2 * 1.5 per entry.
    for result in _results():
        weight, bias = result["grads"]
        assert torch.allclose(weight, torch.full((1, 4), 3.0))
        assert torch.allclose(bias, torch.full((1,), 2.0))
