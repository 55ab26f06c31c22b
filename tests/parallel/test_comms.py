"""mgtutor.parallel.comms: one record of every call a rank makes, its group and its bytes.

One launch of 3 CPU ranks (cached for the module) runs each kind of call once under
``record_comms``: on the default group and on a group of ranks 0 and 1, forward and in
autograd's backward; the tests below each read their part.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mgtutor
from mgtutor.parallel.comms import Comm, by_kind, comm_counts, kind_of, record_comms, record_ops
from mgtutor.parallel.tensor_comms import copy_to_parallel
from mgtutor.ring import bytes_sent_on_ring

WORLD = 3
F64 = 8


def _worker() -> dict[str, Any]:
    mgtutor.setup(backend="gloo")
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 use it
    tail = dist.new_group([1, 2])  # its group ranks are not the global ones: global 1 is its 0
    out: dict[str, Any] = {"world": dist.group.WORLD.group_name, "pair": ""}
    with record_comms() as comms:
        dist.all_reduce(torch.ones(6, dtype=torch.float64))
        whole = torch.empty(6 * WORLD, dtype=torch.float64)
        dist.all_gather_into_tensor(whole, torch.ones(6, dtype=torch.float64))
        dist.reduce_scatter_tensor(torch.empty(6, dtype=torch.float64), whole)
        # rank r sends r + d + 1 rows to rank d: every slice a different size, its own among them
        send = [rank + dst + 1 for dst in range(WORLD)]
        recv = [src + rank + 1 for src in range(WORLD)]
        rows = torch.ones(sum(send), 2, dtype=torch.float64)
        dist.all_to_all_single(
            torch.empty(sum(recv), 2, dtype=torch.float64),
            rows,
            output_split_sizes=recv,
            input_split_sizes=send,
        )
        dist.broadcast(torch.ones(3, dtype=torch.float64), src=0)
        request = dist.isend(torch.ones(5, dtype=torch.float64), dst=(rank + 1) % WORLD)
        dist.recv(torch.empty(5, dtype=torch.float64), src=(rank - 1) % WORLD)
        request.wait()
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        copy_to_parallel(x).sum().backward()  # an all-reduce in autograd's backward
        y = torch.ones(2, dtype=torch.float64, requires_grad=True)
        y.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))
        # and one in a callback autograd runs after the pass's last node, as FSDP2 queues its
        # final reduce-scatters (torch 2.14.1's fsdp/_fully_shard/_fsdp_state.py), through the
        # engine's private queue_callback; a torch without it runs that all-reduce in the hook
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        out["callback"] = hasattr(engine, "queue_callback")
        if out["callback"]:
            y.register_hook(lambda g: engine.queue_callback(lambda: dist.all_reduce(y.grad)))
        else:
            y.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))
        (y * 2).sum().backward()
        dist.all_reduce(y.grad)  # one after backward returned
        if rank < 2:
            out["pair"] = pair.group_name
            dist.all_reduce(torch.ones(6, dtype=torch.float64), group=pair)
        if rank > 0:  # a send and a receive on the tail group, between global ranks 1 and 2
            other = 3 - rank
            request = dist.isend(torch.ones(2, dtype=torch.float64), dst=other, group=tail)
            dist.recv(torch.empty(2, dtype=torch.float64), src=other, group=tail)
            request.wait()
    out["comms"] = list(comms)
    return out


@functools.lru_cache(maxsize=1)
def _run() -> list[dict[str, Any]]:
    return mgtutor.launch(_worker, world_size=WORLD, backend="gloo", timeout=60).results


def _by_op(got: dict[str, Any]) -> dict[str, list[Comm]]:
    out: dict[str, list[Comm]] = {}
    for c in got["comms"]:
        out.setdefault(c.op, []).append(c)
    return out


def test_every_call_is_recorded_in_order_with_its_operator() -> None:
    for rank, got in enumerate(_run()):
        ops = [(c.op, c.operator) for c in got["comms"]]
        assert ops[:7] == [
            ("all_reduce", "c10d.allreduce_"),
            ("all_gather", "c10d._allgather_base_"),
            ("reduce_scatter", "c10d._reduce_scatter_base_"),
            ("all_to_all", "c10d.alltoall_base_"),
            ("broadcast", "c10d.broadcast_"),
            ("send", "c10d.send"),
            ("recv", "c10d.recv_"),
        ]
        assert len(ops) == {0: 12, 1: 14, 2: 13}[rank]


def test_ring_collectives_send_the_planners_bytes_of_the_whole_buffer() -> None:
    for got in _run():
        calls = _by_op(got)
        reduce = calls["all_reduce"][0]
        assert (reduce.buffer, reduce.sent, reduce.received) == (48, 64, 64)  # 2 * 2/3 * 48
        assert reduce.sent == bytes_sent_on_ring("all_reduce", WORLD, 48)
        gather, scatter = calls["all_gather"][0], calls["reduce_scatter"][0]
        # an all-gather's input goes to each of the two other ranks
        assert (gather.buffer, gather.sent, gather.received) == (6 * WORLD * F64, 96, 96)
        assert (scatter.buffer, scatter.sent) == (6 * WORLD * F64, 96)
        assert calls["broadcast"][0].sent == 3 * F64 * 2 // 3


def test_an_all_to_all_leaves_out_this_ranks_own_slice() -> None:
    row = 2 * F64
    for rank, got in enumerate(_run()):
        call = _by_op(got)["all_to_all"][0]
        assert call.sent_to == tuple((rank + dst + 1) * row for dst in range(WORLD))
        assert call.received_from == tuple((src + rank + 1) * row for src in range(WORLD))
        others = [r for r in range(WORLD) if r != rank]
        assert call.sent == sum((rank + dst + 1) * row for dst in others)  # not its own slice
        assert call.received == sum((src + rank + 1) * row for src in others)


def test_a_send_sends_its_tensor_and_a_receive_sends_nothing() -> None:
    for got in _run():
        send, recv = _by_op(got)["send"][0], _by_op(got)["recv"][0]
        assert (send.sent, send.received, send.buffer) == (5 * F64, 0, 5 * F64)
        assert (recv.sent, recv.received, recv.buffer) == (0, 5 * F64, 5 * F64)
    for rank, got in enumerate(_run()):  # each to its right neighbour, each from its left
        send, recv = _by_op(got)["send"][0], _by_op(got)["recv"][0]
        assert (send.peer, recv.peer) == ((rank + 1) % WORLD, (rank - 1) % WORLD)
        assert _by_op(got)["all_reduce"][0].peer is None
        if rank > 0:  # on the tail group the operator gets the group rank; peer is global
            send, recv = _by_op(got)["send"][1], _by_op(got)["recv"][1]
            assert (send.peer, recv.peer, send.group_size) == (3 - rank, 3 - rank, 2)


def test_each_call_names_its_group_and_the_groups_size() -> None:
    for rank, got in enumerate(_run()):
        reduces = _by_op(got)["all_reduce"]
        assert {(c.group, c.group_size) for c in got["comms"][:7]} == {(got["world"], WORLD)}
        if rank < 2:
            pair = reduces[-1]
            assert got["pair"] and got["pair"] != got["world"]
            assert (pair.group, pair.group_size) == (got["pair"], 2)
            assert pair.sent == bytes_sent_on_ring("all_reduce", 2, 48)  # 48, not 64


def test_the_phase_tells_autograds_backward_from_forward() -> None:
    for got in _run():
        # forward; copy_to_parallel's backward; a gradient hook's; autograd's final callback;
        # after backward returned
        phases = [c.phase for c in _by_op(got)["all_reduce"]]
        assert phases[:5] == ["forward", "backward", "backward", "backward", "forward"]
        assert {c.phase for c in got["comms"][:7]} == {"forward"}
    if not _run()[0]["callback"]:
        pytest.skip(
            f"torch {torch.__version__} has no Variable._execution_engine.queue_callback "
            "(private; read in 2.14.1): autograd's final callback was not tried"
        )


def test_kinds_and_counts_read_records_and_torchs_counts_alike() -> None:
    assert kind_of("c10d.allreduce_") == kind_of("c10d_functional.all_reduce") == "all_reduce"
    assert kind_of("c10d._allgather_base_") == "all_gather"
    assert kind_of("_c10d_functional.reduce_scatter_tensor") == "reduce_scatter"
    assert kind_of("c10d.alltoall_base_") == "all_to_all"
    assert kind_of("c10d.recv_") == "recv"
    assert kind_of("c10d.barrier") == "barrier"
    comms = [
        Comm("all_reduce", "c10d.allreduce_", "0", 2, 8, 8, 8, "forward"),
        Comm("all_reduce", "_c10d_functional.all_reduce", "0", 2, 8, 8, 8, "backward"),
        Comm("send", "c10d.send", "0", 2, 8, 8, 0, "forward"),
    ]
    assert comm_counts(comms) == {
        "c10d.allreduce_": 1,
        "_c10d_functional.all_reduce": 1,
        "c10d.send": 1,
    }
    assert by_kind(comms) == by_kind(comm_counts(comms)) == {"all_reduce": 2, "send": 1}


def test_record_ops_lists_the_named_operators_in_order_and_refuses_unknown_names() -> None:
    a = torch.ones(2, 3, 3)
    with record_ops("aten.bmm", "aten.mm") as ops:
        torch.bmm(a, a)
        a[0] @ a[0]  # matmul of two matrices reaches the dispatcher as mm
        a.sum()
        torch.bmm(a, a)
    assert ops == ["aten.bmm", "aten.mm", "aten.bmm"]
    with pytest.raises(ValueError, match="aten.bmmm"), record_ops("aten.bmm", "aten.bmmm"):
        pass
