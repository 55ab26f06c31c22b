"""mgtutor.parallel.pipeline: a hand-built pipeline gives the gradients of one process.

The schedules' orders and tick tables are checked without ranks (against torch's own
``_get_pipeline_order`` where the installed torch has it). One launch of 2 ranks (cached) runs
GPipe and 1F1B by hand, and the tests read its results: gradients against the whole model in
one process, the messages sent (count and bytes), the micro-batches held at once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import mgtutor
from mgtutor.parallel.comms import comm_counts, record_comms
from mgtutor.parallel.pipeline import (
    HandStage,
    HeldMicroBatches,
    bubble_fraction,
    gpipe_order,
    max_in_flight,
    one_f_one_b_order,
    replay_ticks,
    run_order,
    split_stages,
    tick_table,
)

HIDDEN, MICRO, N_MICRO = 6, 3, 4
TORCH_SCALES_GRADS = "scale_grads" in inspect.signature(Schedule1F1B.__init__).parameters


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*layers).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_MICRO * MICRO, HIDDEN, generator=gen, dtype=torch.float64)
    return x, torch.randn(N_MICRO * MICRO, HIDDEN, generator=gen, dtype=torch.float64)


def _sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("n_micro", [1, 4, 8])
def test_tick_tables_idle_the_formulas_share_and_hold_the_expected_micro_batches(
    n_stages: int, n_micro: int
) -> None:
    for name, orders in {
        "gpipe": [gpipe_order(n_micro)] * n_stages,
        "1f1b": [one_f_one_b_order(s, n_stages, n_micro) for s in range(n_stages)],
    }.items():
        rows = tick_table(orders)
        assert len(rows[0]) == 2 * (n_micro + n_stages - 1), name
        for s, row in enumerate(rows):
            assert [a for a in row if a is not None] == list(orders[s]), name
            idle = sum(a is None for a in row) / len(row)
            assert idle == pytest.approx(bubble_fraction(n_stages, n_micro)), (name, s)
            expected = n_micro if name == "gpipe" else min(n_stages - s, n_micro)
            assert max_in_flight(orders[s]) == expected, (name, s)


@pytest.mark.parametrize("n_stages", [2, 4])
@pytest.mark.parametrize("n_micro", [1, 4, 8])
def test_the_bubble_formula_needs_equal_stages_not_a_backward_as_long_as_a_forward(
    n_stages: int, n_micro: int
) -> None:
    for orders in (
        [gpipe_order(n_micro)] * n_stages,
        [one_f_one_b_order(s, n_stages, n_micro) for s in range(n_stages)],
    ):
        slow_backward = tick_table(orders, lambda stage, kind: 1 if kind == "F" else 3)
        for s, row in enumerate(slow_backward):
            assert sum(a is None for a in row) / len(row) == pytest.approx(
                bubble_fraction(n_stages, n_micro)
            )
            repeated = [a for a in orders[s] for _ in range(1 if a[0] == "F" else 3)]
            assert [a for a in row if a] == repeated
        slow_last = tick_table(orders, lambda stage, kind: 2 if stage == n_stages - 1 else 1)
        idle = [sum(a is None for a in row) / len(row) for row in slow_last]
        assert all(f > bubble_fraction(n_stages, n_micro) for f in idle[:-1])
        assert idle[-1] < bubble_fraction(n_stages, n_micro)


def test_tick_table_reports_orders_that_wait_for_each_other() -> None:
    # The last stage backward before its forward: nothing can ever run.
    with pytest.raises(ValueError, match="deadlock"):
        tick_table([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]])


def test_split_stages_cuts_consecutive_layers_and_refuses_too_many() -> None:
    stages = split_stages(_model(), 3)
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1"], ["2"], ["3"]]
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5 stages"):
        split_stages(_model(), 5)


def test_the_last_stage_refuses_to_start_without_a_loss() -> None:
    with pytest.raises(ValueError, match="stage 1 is the last of 2: .* give it loss_fn"):
        HandStage(nn.Linear(2, 2), 1, 2, (1, 2))
    HandStage(nn.Linear(2, 2), 0, 2, (1, 2))  # the first stage needs none


def test_a_stage_refuses_ranks_that_are_not_one_distinct_rank_per_stage() -> None:
    for ranks in ([0, 4, 8], [4, 4]):
        with pytest.raises(ValueError, match=r"stage 0: ranks=.* must name 2 distinct global"):
            HandStage(nn.Linear(2, 2), 0, 2, (1, 2), ranks=ranks)
    assert HandStage(nn.Linear(2, 2), 0, 2, (1, 2), ranks=[4, 0]).ranks == [4, 0]


class _LeakyStage(HandStage):
    """A stage that forgets to let go: it keeps every micro-batch's input and output."""

    def backward(self, i: int, grad: torch.Tensor | None = None) -> None:
        self.leaked = [*getattr(self, "leaked", []), self._kept[i]]
        super().backward(i, grad)


def _pipeline_worker(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    mgtutor.setup(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module = split_stages(model, world)[rank]
    inputs, targets = x.chunk(N_MICRO), y.chunk(N_MICRO)
    result = {}
    for name, order, cls in [
        ("gpipe", gpipe_order(N_MICRO), HandStage),
        ("1f1b", one_f_one_b_order(rank, world, N_MICRO), HandStage),
        ("1f1b, leaking", one_f_one_b_order(rank, world, N_MICRO), _LeakyStage),
    ]:
        module.zero_grad(set_to_none=True)
        stage = cls(module, rank, world, (MICRO, HIDDEN), torch.float64, _sum_mse)
        held = HeldMicroBatches(skip=[*module.parameters(), x])
        phases: list[str] = []
        with record_comms() as p2p:
            run_order(stage, order, inputs, targets, held=held, phase=_noting(phases))
        result[name] = {
            "phases": phases,
            "grads": _grads(module),
            "sent": stage.sent,
            "held": held.peak,
            "losses": stage.losses,
            "p2p": (comm_counts(p2p), sum(c.sent for c in p2p)),
        }
    if TORCH_SCALES_GRADS:
        for cls, scale in [(ScheduleGPipe, False), (Schedule1F1B, False), (Schedule1F1B, True)]:
            module.zero_grad(set_to_none=True)
            order = _run_torch(cls, scale, module, rank, world, x, y)
            result[cls.__name__, scale] = {"order": order, "grads": _grads(module)}
    return result


def _noting(names: list[str]) -> Any:
    """A ``phase`` for run_order that notes each phase's name as it is entered."""

    @contextlib.contextmanager
    def phase(name: str) -> Any:
        names.append(name)
        yield

    return phase


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _run_torch(cls: type, scale: bool, module: nn.Module, rank: int, world: int, x, y) -> list:
    """Run torch's schedule; the (kind, micro-batch) order it ran this stage in, recorded."""
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    order = []
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(i, *args, **kwargs):
        order.append(("F", i))
        return forward(i, *args, **kwargs)

    def backward_one_chunk(i, *args, **kwargs):
        order.append(("B", i))
        return backward(i, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    schedule = cls(stage, N_MICRO, loss_fn=_sum_mse, scale_grads=scale)
    schedule.step(*([x] if rank == 0 else []), **({"target": y} if rank == world - 1 else {}))
    return order


@functools.cache
def _launch() -> list[dict[str, Any]]:
    return mgtutor.launch(_pipeline_worker, _model(), *_batch(), world_size=2, timeout=60).results


@pytest.mark.skipif(
    not TORCH_SCALES_GRADS,
    reason=f"torch {torch.__version__}'s schedules have no scale_grads (2.14.1 has)",
)
def test_torchs_schedules_run_the_hand_built_orders_with_the_same_gradients() -> None:
    for rank, result in enumerate(_launch()):
        assert result["ScheduleGPipe", False]["order"] == gpipe_order(N_MICRO)
        assert result["Schedule1F1B", False]["order"] == one_f_one_b_order(rank, 2, N_MICRO)
        for name, grad in result["gpipe"]["grads"].items():
            for cls in ("ScheduleGPipe", "Schedule1F1B"):
                torch.testing.assert_close(result[cls, False]["grads"][name], grad)
            # By default a schedule divides the gradients by the number of micro-batches.
            torch.testing.assert_close(result["Schedule1F1B", True]["grads"][name], grad / N_MICRO)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hand_built_schedules_give_one_process_gradients(schedule: str) -> None:
    model = _model()
    x, y = _batch()
    loss = _sum_mse(model(x), y)
    loss.backward()
    ranks = [r[schedule] for r in _launch()]
    got = {n: g for r in ranks for n, g in r["grads"].items()}
    assert sorted(got) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-12, atol=1e-12)
    assert ranks[0]["losses"] == []
    torch.testing.assert_close(sum(ranks[1]["losses"]), loss.detach())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_boundary_carries_one_message_per_micro_batch_each_way(schedule: str) -> None:
    first, last = (r[schedule]["sent"] for r in _launch())
    nbytes = MICRO * HIDDEN * 8  # one float64 activation (or its gradient) per micro-batch
    assert first == [("activation", 1, nbytes)] * N_MICRO
    assert last == [("gradient", 0, nbytes)] * N_MICRO


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_the_stages_left() -> None:
    gpipe, one_f_one_b = ([r[s]["held"] for r in _launch()] for s in ("gpipe", "1f1b"))
    assert gpipe == [N_MICRO, N_MICRO]
    assert one_f_one_b == [2, 1]


def test_a_stage_that_keeps_every_micro_batch_is_measured_holding_them_all() -> None:
    assert [r["1f1b, leaking"]["held"] for r in _launch()] == [N_MICRO, N_MICRO]
    assert max_in_flight(one_f_one_b_order(0, 2, N_MICRO)) == 2  # what its order would say


def test_the_p2p_counter_sees_every_send_and_receive_that_ran() -> None:
    nbytes = MICRO * HIDDEN * 8
    for r in _launch():
        for schedule in ("gpipe", "1f1b"):
            counts = {"c10d.send": N_MICRO, "c10d.recv_": N_MICRO}
            assert r[schedule]["p2p"] == (counts, N_MICRO * nbytes)


def test_replay_finds_the_interleaved_bubble_in_torchs_orders() -> None:
    # torch 2.14's ScheduleInterleaved1F1B, 2 ranks, stages (0, 2) and (1, 3), 4 micro-batches
    ranks = [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    orders = [[(int(a[0]), a[1], int(a[2:])) for a in r.split()] for r in ranks]
    rows = replay_ticks(orders, 4)
    assert [sum(a is None for a in row) for row in rows] == [2, 2]  # 2 (p - 1) chunk ticks
    assert [[a for a in row if a] for row in rows] == orders
    with pytest.raises(ValueError, match="deadlock"):
        replay_ticks([[(0, "W", 0)], []], 2)  # a weight gradient before its input gradient


def test_run_order_marks_each_action_as_a_wait_then_its_compute_in_the_phase_it_is_given() -> None:
    for rank, result in enumerate(_launch()):
        for name, order in [
            ("gpipe", gpipe_order(N_MICRO)),
            ("1f1b", one_f_one_b_order(rank, 2, N_MICRO)),
        ]:
            kinds = ["forward" if kind == "F" else "backward" for kind, _ in order]
            assert result[name]["phases"] == [p for k in kinds for p in ("wait", k)], (rank, name)
