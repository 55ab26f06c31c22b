"""A rank that joins the group and leaves at once must not break a peer that is slow to join.

gloo counts a connection as made once one side has written its handshake into the other's
socket; without a barrier at the end of init_process_group, a rank whose function returns right
after joining could exit, closing that socket, while its peer was still connecting, and the peer
failed in connectFullMesh with "Connection closed by peer". A busy machine made that peer slow
(notebook 13's dropout_masks failed so, with two test suites running). Here the slow rank is
made slow on purpose: it shares one core with a busy process, at the lowest priority.
"""

from __future__ import annotations

import os

import pytest

import mgtutor
from tests.helpers import worker_children

# Without the barrier, 2 in 3 launches failed here with torch 2.13-2.15, 1 in 3 with 2.11; each
# launch takes about a second.
LAUNCHES = 6

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="pins a rank to one core, which needs Linux"
)


def join_and_leave(slow_rank: int, how: str) -> int:
    """Join the group and return at once; rank ``slow_rank`` joins starved of CPU time."""
    import subprocess
    import sys

    import torch.distributed as dist

    import mgtutor

    burner = None
    if int(os.environ["RANK"]) == slow_rank:
        core = min(os.sched_getaffinity(0))
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(burner.pid, {core})
        os.sched_setaffinity(0, {core})  # threads started from now on (gloo's) inherit both
        os.nice(19)
    try:
        if how == "setup":
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)  # as under torchrun, which sets none
            mgtutor.setup()
        else:
            dist.init_process_group("gloo")  # a function that joins by itself
        return dist.get_world_size()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


@pytest.mark.parametrize("how", ["setup", "init_process_group"])
def test_a_rank_that_leaves_at_once_does_not_break_a_slow_peers_join(how, monkeypatch) -> None:
    monkeypatch.delenv("TORCH_DIST_INIT_BARRIER", raising=False)
    for launch in range(LAUNCHES):
        slow_rank = launch % 2
        assert mgtutor.launch(join_and_leave, slow_rank, how, world_size=2).results == [2, 2]
    assert worker_children() == [], "a launch left a rank or its busy process running"
