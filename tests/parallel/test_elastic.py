"""mgtutor.parallel.elastic: a replica killed at random steps rejoins; no step lost or doubled.

Each run kills replica 1 twice (SIGKILL before its all-reduce) at steps drawn at random, prints
them, and checks the run against a one-process replay of the membership it recorded.
"""

from __future__ import annotations

import random

import pytest
import torch

from mgtutor.parallel.elastic import replay, run_replicas

STEPS, SIZE = 40, 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_replica_killed_twice_rejoins(seed: int) -> None:
    draw = random.Random()  # a fresh draw each run, shown in the output when it fails
    first = draw.randrange(2, 12)
    kills = [first, draw.randrange(first + 6, 26)]
    print(f"seed {seed}: replica 1 dies at steps {kills}")
    run = run_replicas(3, steps=STEPS, size=SIZE, kills=kills, rejoin_after=2, timeout=240)
    assert [rid for rid, _ in run.deaths] == [1, 1], run.deaths
    assert run.deaths[0][1] == kills[0]
    assert run.deaths[1][1] >= kills[1]
    assert run.lives == {0: 1, 1: 3, 2: 1}
    assert run.commits == [1] * STEPS  # every step committed once: none lost, none doubled
    gone = [s for s, m in enumerate(run.members) if m != [0, 1, 2]]
    assert gone and all(run.members[s] == [0, 2] for s in gone)
    assert run.members[-1] == [0, 1, 2]
    samples = sum(SIZE * len(m) for m in run.members)
    assert samples < STEPS * SIZE * 3
    reference = replay(run.members, SIZE)
    for rid, final in run.final.items():
        assert final["step"] == STEPS and final["samples"] == samples, (rid, final)
        params = torch.tensor(final["params"], dtype=torch.float64)
        assert torch.allclose(params, reference, rtol=0, atol=1e-12), rid


def test_replay_tells_an_outage_from_none() -> None:
    whole = replay([[0, 1, 2]] * 6)
    assert not torch.allclose(replay([[0, 1, 2]] * 3 + [[0, 2]] * 3), whole, atol=1e-6)
    assert torch.equal(replay([[0, 1, 2]] * 6), whole)
