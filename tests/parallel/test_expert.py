"""mgtutor.parallel.expert: a mixture of experts on 2 CPU ranks equals one process, both ways.

Routing, capacity, the auxiliary loss and the dispatch plan are pure functions, tested here. The
layer on ranks needs them: one cached launch of 2 ranks (4 experts, 2 each) runs it with and
without a capacity limit, and the tests below each read their part of its results.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mgtutor
from mgtutor.parallel import expert
from mgtutor.parallel.comms import record_comms

DIM, HIDDEN, EXPERTS, K, TOKENS, WORLD = 8, 16, 4, 2, 12, 2  # TOKENS per rank


def test_capacity_counts_assignments_and_rounds_up() -> None:
    assert expert.capacity(12, 4, 2, 1.0) == 6  # 12 tokens, 2 choices each, over 4 experts
    assert expert.capacity(12, 4, 2, 1.25) == 8  # 7.5 rounded up
    assert expert.capacity(10, 4, 1, 1.0) == 3


def test_first_choices_fill_an_expert_before_any_second_choice() -> None:
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])
    keep = expert.keep_within_capacity(experts, 3, cap=2)
    # expert 0 takes the first choices of tokens 0 and 1 and drops token 3's (its third) and
    # token 2's second choice; expert 1 takes token 2's first choice, then token 0's second,
    # and is full for token 1's second
    assert keep.tolist() == [[True, True], [True, False], [True, False], [False, True]]
    assert bool(expert.keep_within_capacity(experts, 3, None).all())


def test_the_auxiliary_loss_is_one_when_routing_is_uniform_and_more_when_skewed() -> None:
    probs = torch.full((8, 4), 0.25)
    experts = torch.arange(8).remainder(4).unsqueeze(1)
    assert expert.load_balancing_loss(probs, experts).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    loss = expert.load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long))
    assert loss.item() == pytest.approx(4 * 0.7)  # f = (1, 0, 0, 0), P_0 = 0.7


def test_the_auxiliary_loss_can_be_below_one_so_one_is_not_its_minimum() -> None:
    # Most tokens barely prefer expert 0, a few are sure of expert 1: f = (0.9, 0.1) and
    # P = (0.459, 0.541), so 2 * (0.9 * 0.459 + 0.1 * 0.541) = 0.9344.
    probs = torch.tensor([[0.51, 0.49]] * 90 + [[0.0, 1.0]] * 10, dtype=torch.float64)
    loss = expert.load_balancing_loss(probs, probs.argmax(1, keepdim=True))
    assert loss.item() == pytest.approx(0.9344)


def test_the_plan_groups_kept_assignments_by_expert_and_counts_rows_per_rank() -> None:
    experts = torch.tensor([[3, 0], [1, 2], [0, 3]])
    keep = torch.tensor([[True, True], [True, False], [True, True]])
    order, per_expert, send = expert.plan_dispatch(experts, keep, experts_per_rank=2, world=2)
    assert order.tolist() == [1, 4, 2, 0, 5]  # experts 0, 0, 1, 3, 3
    assert per_expert.tolist() == [2, 1, 0, 2] and send == [3, 2]


def _layer_and_tokens(
    capacity_factor: float | None, starved: bool
) -> tuple[expert.MoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = expert.MoE(DIM, HIDDEN, EXPERTS, K, capacity_factor).double()
    x = torch.randn(TOKENS * WORLD, DIM, dtype=torch.float64)
    if starved:  # feature 0 is large on every token and scores only experts 0 and 1
        x[:, 0] = 10.0
        with torch.no_grad():
            moe.router.weight[:, 0] = torch.tensor([5.0, 5.0, -5.0, -5.0])
    return moe, x


def _worker(capacity_factor: float | None, starved: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    moe, x = _layer_and_tokens(capacity_factor, starved)
    x.requires_grad_()
    grad_y = torch.randn(TOKENS * WORLD, DIM, dtype=torch.float64)
    y, aux = moe(x, groups=WORLD)
    ((y * grad_y).sum() + aux).backward()

    ep = expert.ExpertParallelMoE(moe)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x_mine = x.detach()[mine].clone().requires_grad_()
    reference_router = moe.router.weight.grad.clone()
    first = rank * EXPERTS // WORLD
    reference_experts = [
        p.grad.clone() for p in moe.experts[first : first + EXPERTS // WORLD].parameters()
    ]
    moe.zero_grad()
    with record_comms() as comms:
        y_mine, aux_mine = ep(x_mine)
        ((y_mine * grad_y[mine]).sum() + aux_mine / WORLD).backward()
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    r = moe.route(x.detach()[mine])
    held = sum(p.numel() for p in ep.parameters())
    return {
        "held": held == moe.router.weight.numel() + sum(p.numel() for p in ep.experts.parameters()),
        "y": torch.allclose(y_mine, y.detach()[mine]),
        "aux_sum": aux_mine.detach(),
        "aux": aux.detach(),
        "x_grad": torch.allclose(x_mine.grad, x.grad[mine]),
        "router_equal": torch.allclose(router_grad, reference_router),
        "expert_grads": all(
            torch.allclose(p.grad, q) for p, q in zip(ep.experts.parameters(), reference_experts)
        ),
        "log": [(c.phase, c.sent_to, c.received_from) for c in comms if c.op == "all_to_all"],
        "sent": [(c.sent, c.received) for c in comms],
        "groups": {(c.group, c.group_size) for c in comms},
        "world": dist.group.WORLD.group_name,
        "arrived": ep.last["arrived"],
        "last": ep.last,
        "experts": r["experts"],
        "keep": r["keep"],
    }


CONFIGS = ((None, False), (1.0, False), (None, True))  # capacity factor, rank 1 starved


def _all_configs() -> list[dict[Any, Any]]:
    mgtutor.setup(backend="gloo")
    return [_worker(*config) for config in CONFIGS]


@functools.lru_cache(maxsize=1)
def _run() -> list[list[dict[str, Any]]]:
    return mgtutor.launch(_all_configs, world_size=WORLD, backend="gloo", timeout=60).results


@pytest.mark.parametrize(
    "case", [0, 1, 2], ids=["no capacity", "capacity factor 1.0", "rank 1 receives nothing"]
)
def test_output_and_every_gradient_equal_one_process(case: int) -> None:
    for rank in _run():
        got = rank[case]
        assert got["y"] and got["x_grad"] and got["router_equal"] and got["expert_grads"]
    assert [rank[2]["last"]["send"][1] for rank in _run()] == [0, 0]  # the case is what it says


def test_the_layer_on_a_rank_holds_the_router_and_its_own_experts_only() -> None:
    assert all(config["held"] for rank in _run() for config in rank)


def test_each_rank_sends_the_rows_its_tokens_route_to_the_other_rank_and_receives_theirs() -> None:
    for case in range(len(CONFIGS)):
        ranks = [r[case] for r in _run()]
        for rank, got in enumerate(ranks):
            per_rank = torch.tensor(got["last"]["per_expert"]).reshape(WORLD, -1).sum(1).tolist()
            assert got["last"]["send"] == per_rank
            assert got["last"]["recv"] == [r["last"]["send"][rank] for r in ranks]
            kept = int(got["keep"].sum())
            assert sum(got["last"]["send"]) == kept == K * TOKENS - got["last"]["dropped"]


def test_the_backward_of_a_dispatch_is_a_combine_shaped_all_to_all() -> None:
    row = DIM * 8  # float64
    for rank in _run():
        got = rank[0]
        send = tuple(n * row for n in got["last"]["send"])
        recv = tuple(n * row for n in got["last"]["recv"])
        assert got["log"] == [
            ("forward", (EXPERTS // WORLD * 8,) * WORLD, (EXPERTS // WORLD * 8,) * WORLD),  # counts
            ("forward", send, recv),  # dispatch
            ("forward", recv, send),  # combine
            ("backward", send, recv),  # combine's backward: dispatch-shaped
            ("backward", recv, send),  # dispatch's backward: combine-shaped
        ]


@pytest.mark.parametrize("case", [0, 1, 2])
def test_an_all_to_all_sends_and_receives_all_but_this_ranks_own_slice(case: int) -> None:
    row = DIM * 8  # float64
    for rank, got in enumerate(r[case] for r in _run()):
        send, recv = got["last"]["send"], got["last"]["recv"]
        sent = row * (sum(send) - send[rank])  # this rank's own rows never leave it
        received = row * (sum(recv) - recv[rank])
        counts = EXPERTS // WORLD * 8 * (WORLD - 1)  # one int64 per expert of each other rank
        assert got["sent"] == [
            (counts, counts),
            (sent, received),  # dispatch
            (received, sent),  # combine
            (sent, received),  # combine's backward
            (received, sent),  # dispatch's backward
        ]
        assert got["groups"] == {(got["world"], WORLD)}


@pytest.mark.parametrize("case", [0, 1, 2])
def test_the_layer_keeps_the_rows_that_arrived_the_other_ranks_kept_tokens(case: int) -> None:
    moe, x = _layer_and_tokens(*CONFIGS[case])
    for rank, got in enumerate(r[case] for r in _run()):
        expected = []  # each source rank's kept tokens for this rank's experts, by expert
        for src in range(WORLD):
            r = moe.route(x[src * TOKENS : (src + 1) * TOKENS])
            for e in range(rank * EXPERTS // WORLD, (rank + 1) * EXPERTS // WORLD):
                tokens, _ = ((r["experts"] == e) & r["keep"]).nonzero(as_tuple=True)
                expected.append(x[src * TOKENS + tokens])
        assert torch.equal(got["arrived"], torch.cat(expected))


def test_capacity_one_drops_exactly_the_assignments_past_each_experts_capacity() -> None:
    cap = expert.capacity(TOKENS, EXPERTS, K, 1.0)
    dropped = [rank[1]["last"]["dropped"] for rank in _run()]
    for rank, n in zip(_run(), dropped):
        counts = torch.bincount(rank[1]["experts"].reshape(-1), minlength=EXPERTS)
        assert n == int((counts - cap).clamp(min=0).sum())
    assert sum(dropped) > 0  # the case tests something: this seed overloads an expert
    assert all(rank[0]["last"]["dropped"] == 0 for rank in _run())


def test_the_ranks_auxiliary_losses_average_to_the_one_process_loss() -> None:
    ranks = [r[0] for r in _run()]
    mean = sum(r["aux_sum"] for r in ranks) / WORLD
    assert torch.allclose(mean, ranks[0]["aux"])


def test_send_splits_that_do_not_add_up_are_refused_with_what_to_do() -> None:
    def bad() -> None:
        mgtutor.setup(backend="gloo")
        expert.all_to_all(torch.zeros(3, 2), [1, 1], [1, 1])

    with pytest.raises(mgtutor.WorkerError, match="one count per rank"):
        mgtutor.launch(bad, world_size=WORLD, backend="gloo", timeout=30)
