"""traffic: every call counted in 2 CPU ranks against torch's pattern and the planner's.

One launch (cached for the module) trains :func:`traffic.build`'s model for three steps under
DDP, DDP + ZeroRedundancyOptimizer, FSDP2 with and without resharding after forward, and a
2-stage 1F1B pipeline, recording every call each rank makes to a process group, and (torch
2.14) Flight Recorder's entries for the same steps. Before them, an all-reduce on a subgroup of
the same ranks and one on the default group check that each call names its own group.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

import mgtutor
from mgtutor.build import torch_release
from mgtutor.doctor.record import recorder_available
from mgtutor.experiments import traffic
from mgtutor.parallel.comms import Comm, record_comms
from mgtutor.plan.planner import plan
from mgtutor.plan.shape import Transformer

GB = 10**9
# An odd vocabulary: the embedding's 11 rows are padded to 12 by FSDP2 on 2 ranks.
SHAPE = Transformer(layers=2, hidden=8, heads=2, seq_len=4, micro_batch=3, ffn=16, vocab=11)
MICRO = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "pp": 4}
ZERO = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
P = SHAPE.total * 4  # float32 bytes of every parameter
ROOT_PADDED = 12 * 8 * 4  # the embedding, 11 rows padded to 12
PADDED = P + 1 * 8 * 4  # one padding row of the embedding; the layers' dims (8, 16) split evenly


def _gloo_entries() -> list[tuple[str, int]]:
    """Flight Recorder's entries: each call's name and the bytes of its (first) input."""
    itemsize = {"Float": 4, "Int": 4, "Long": 8, "Byte": 1}
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return [
        (e["profiling_name"], math.prod(e["input_sizes"][0]) * itemsize[e["input_dtypes"][0]])
        for e in dump["entries"]
    ]


def _written_by_collectives() -> dict[str, int | None]:
    """Bytes this rank wrote to its sockets around an all-reduce and a reduce-scatter of one
    32 KiB buffer, each with 4 KiB printed beside it (and torch 2.14's reduce_scatter_tensor
    warns): SocketWrites must leave what was printed out."""
    import sys

    import torch.distributed as dist

    out = {}
    for name in ("all_reduce", "reduce_scatter"):
        buffer = torch.ones(8192)  # float32, as the recorder's entries below are read
        with traffic.SocketWrites() as written:
            print("." * 2047)
            print("." * 2047, file=sys.stderr)
            if name == "all_reduce":
                dist.all_reduce(buffer)
            else:
                dist.reduce_scatter_tensor(torch.empty(4096), buffer)
        out[name] = written.nbytes
    return out


def _record_on_two_groups() -> dict[str, object]:
    """An all-reduce on a subgroup, then one on the default group, recorded."""
    import torch.distributed as dist

    # The default group's ranks under another name: their size alone cannot tell them apart.
    sub = dist.new_group([0, 1])
    with record_comms() as calls:
        dist.all_reduce(torch.ones(2), group=sub)
        dist.all_reduce(torch.ones(2))
    return {"calls": calls, "sub": sub.group_name, "default": dist.group.WORLD.group_name}


def _count_in_ranks() -> dict:
    mgtutor.setup()
    recorder, _ = recorder_available()
    out = {"missing": {}}
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  public from torch 2.6
    except ImportError:
        out["missing"]["zero2"] = out["missing"]["zero3"] = "no torch.distributed.fsdp.fully_shard"
    if torch_release() < (2, 6):  # older gloo pipelines could hang (pytorch#132644)
        out["missing"]["pp"] = "the pipeline case runs with torch >= 2.6 only"
    out["written"] = _written_by_collectives()
    out["groups"] = _record_on_two_groups()
    for strategy, micro in MICRO.items():
        if strategy in out["missing"]:
            continue
        before = len(_gloo_entries()) if recorder else 0
        out[strategy] = traffic.count_steps(strategy, SHAPE, micro_batches=micro)
        if recorder:
            out[strategy, "gloo"] = _gloo_entries()[before:]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return mgtutor.launch(_count_in_ranks, world_size=2, backend="gloo", timeout=120).results


def _steps(ranks: list[dict], strategy: str) -> list[list[list[Comm]]]:
    if strategy in ranks[0]["missing"]:
        pytest.skip(f"torch {torch.__version__}: {ranks[0]['missing'][strategy]}")
    return [r[strategy] for r in ranks]


def _comm(op: str, size: int, buffer: int) -> Comm:
    # sent and received 0: the tally reads the buffer, not what the recorder counted
    return Comm(op, f"c10d.{op}", "g", size, buffer, 0, 0, "forward")


def test_the_tally_sends_the_rings_bytes_of_each_buffer() -> None:
    n, buffer = 4, 400

    def sent(op: str, size: int = n) -> int:
        (collective,) = traffic.tally([_comm(op, size, buffer)])
        return collective.sent_bytes

    assert sent("all_reduce") == 2 * 3 * buffer // 4
    for name in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert sent(name) == 3 * buffer // 4, name
    assert sent("send", 2) == buffer
    assert sent("barrier", 2) == 0
    assert traffic.tally([_comm("recv", 2, buffer)]) == ()  # a receive sends nothing


def test_the_tally_refuses_calls_of_two_groups_under_one_label() -> None:
    # The label is the caller's word: calls of a dp group and a tp group of one size would be
    # counted as one axis's, which no count could catch.
    one, other = (
        _comm("all_reduce", 2, 8),
        dataclasses.replace(_comm("all_reduce", 2, 8), group="h"),
    )
    assert traffic.tally([one, one])[0].calls == 2
    with pytest.raises(ValueError, match=r"ran on 2 process groups \(g, h\)"):
        traffic.tally([one, other], "tp")


def test_each_call_names_the_group_it_went_to(ranks) -> None:
    for recorded in (rank["groups"] for rank in ranks):
        assert recorded["sub"] != recorded["default"]
        assert [(c.op, c.group_size, c.group) for c in recorded["calls"]] == [
            ("all_reduce", 2, recorded["sub"]),
            ("all_reduce", 2, recorded["default"]),
        ]


def test_build_holds_the_planners_parameter_count() -> None:
    for shape in (SHAPE, Transformer(layers=3, hidden=12, heads=3, seq_len=2)):
        assert sum(p.numel() for p in traffic.build(shape).parameters()) == shape.total
    by_count = Transformer(layers=1, hidden=1, heads=1, seq_len=1, params=10)
    with pytest.raises(ValueError, match="no layer shapes"):
        traffic.build(by_count)
    with pytest.raises(ValueError, match="no layer shapes"):
        traffic.torch_collectives(by_count, 2, 3)
    with pytest.raises(ValueError, match="ZeRO stage"):
        traffic.torch_collectives(SHAPE, 2, 4)


@pytest.mark.parametrize("strategy", list(ZERO))
def test_counted_calls_equal_torchs_pattern(ranks, strategy) -> None:
    expected = traffic.torch_collectives(SHAPE, 2, ZERO[strategy], micro_batches=MICRO[strategy])
    for steps in _steps(ranks, strategy):
        assert traffic.tally(steps[-1]) == expected


def test_ddp_sends_what_the_planner_plans(ranks) -> None:
    ddp = plan(SHAPE, 2, GB, precision="fp32", micro_batches=MICRO["ddp"]).collectives
    for steps in _steps(ranks, "ddp"):
        assert traffic.tally(steps[-1]) == ddp  # one all-reduce per step (no_sync before)


def test_the_pipeline_sends_what_the_planner_plans(ranks) -> None:
    pp = plan(SHAPE, 2, GB, pp=2, precision="fp32", micro_batches=MICRO["pp"]).collectives
    activation = SHAPE.micro_batch * SHAPE.seq_len * SHAPE.hidden * 4
    for steps in _steps(ranks, "pp"):  # rank 0 sends activations, rank 1 their gradients
        assert traffic.tally(steps[-1], "pp") == pp
        received = [c.buffer for c in steps[-1] if c.op == "recv"]
        assert received == [activation] * MICRO["pp"]


def test_torchs_zero1_sends_half_again_the_papers(ranks) -> None:
    paper = traffic.totals(plan(SHAPE, 2, GB, zero=1, precision="fp32").collectives)
    assert paper == {"reduce_scatter": (1, P, P // 2), "all_gather": (1, P, P // 2)}
    tensors = len(list(traffic.build(SHAPE).parameters()))
    for steps in _steps(ranks, "zero1"):
        torch_zero1 = traffic.totals(traffic.tally(steps[-1]))
        # DDP's all-reduce, then every parameter broadcast from the rank that updated it.
        assert torch_zero1 == {"all_reduce": (1, P, P), "broadcast": (tensors, P, P // 2)}
        sent = [sum(s for _, _, s in t.values()) for t in (torch_zero1, paper)]
        assert 2 * sent[0] == 3 * sent[1]


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_differs_from_the_paper_by_padding_the_root_and_micro_batches(ranks, zero) -> None:
    m = MICRO[f"zero{zero}"]
    paper = traffic.totals(
        plan(SHAPE, 2, GB, zero=zero, precision="fp32", micro_batches=m).collectives
    )
    # The paper: ZeRO-3 gathers the parameters twice per micro-batch, ZeRO-2 once per step;
    # both reduce-scatter the gradients per micro-batch (DeepSpeed does so for ZeRO-2 too:
    # https://github.com/deepspeedai/DeepSpeed/issues/2252).
    assert paper["all_gather"][1] == (2 * m if zero == 3 else 1) * P
    assert paper["reduce_scatter"][1] == m * P
    # torch: padded units, every micro-batch, and the root gathered once.
    gathered = m * (2 * PADDED - ROOT_PADDED if zero == 3 else PADDED)
    for steps in _steps(ranks, f"zero{zero}"):
        counted = traffic.totals(traffic.tally(steps[-1]))
        assert counted["all_gather"][1] == gathered
        assert counted["reduce_scatter"][1] == m * PADDED


def test_ddps_second_step_broadcasts_its_rebuilt_buckets(ranks) -> None:
    tensors = len(list(traffic.build(SHAPE).parameters()))
    for steps in _steps(ranks, "ddp"):
        assert traffic.tally(steps[0]) == traffic.tally(steps[2])
        extra = [c for c in steps[1] if c not in steps[2]]
        # Reducer::sync_bucket_indices: int32 indices of every parameter plus the bucket
        # count, then each bucket's size (one bucket here), broadcast from rank 0.
        assert [(c.op, c.buffer) for c in extra] == [
            ("broadcast", 4 * (tensors + 1)),
            ("broadcast", 4),
        ]


def test_the_pipelines_first_step_exchanges_shapes(ranks) -> None:
    for steps in _steps(ranks, "pp"):
        assert traffic.tally(steps[1], "pp") == traffic.tally(steps[2], "pp")
        assert len(steps[0]) > len(steps[1])


def _opname(comm: Comm) -> str:
    return comm.operator.split(".", 1)[1]  # "c10d.allreduce_": "allreduce_"


def test_flight_recorder_sees_the_same_collectives_and_gloos_reduce_scatter_all_reduces(ranks):
    available, why = recorder_available()
    if not available:
        pytest.skip(why)
    gloo = {"allreduce_": "gloo:all_reduce", "broadcast_": "gloo:broadcast"}
    gloo |= {"_allgather_base_": "gloo:all_gather", "_reduce_scatter_base_": "gloo:all_reduce"}
    for strategy in ("ddp", "zero1", "zero2", "zero3", "pp"):
        for rank in ranks:
            if strategy in rank["missing"]:
                continue
            calls = [c for step in rank[strategy] for c in step if c.op not in ("send", "recv")]
            entries = rank[strategy, "gloo"][len(rank[strategy, "gloo"]) - len(calls) :]
            assert [name for name, _ in entries] == [gloo[_opname(c)] for c in calls], strategy
            # gloo records an all-gather's input (one shard of 2), the others' whole buffer.
            shards = [2 if _opname(c) == "_allgather_base_" else 1 for c in calls]
            assert [b * n for (_, b), n in zip(entries, shards)] == [c.buffer for c in calls]
    if "pp" not in ranks[0]["missing"]:
        # gloo's recorder keeps no send or recv: only the pipeline's collectives (none up to
        # torch 2.14; 2.15's schedules add two all-reduces at the first step, setting up p2p).
        for rank in ranks:
            collectives = [c for step in rank["pp"] for c in step if c.op not in ("send", "recv")]
            assert len(rank["pp", "gloo"]) == len(collectives)


def test_bytes_written_sees_what_gloo_sends(ranks) -> None:
    # A ring all-reduce of B bytes on 2 ranks sends B per rank; gloo's reduce-scatter, an
    # all-reduce of the whole buffer, sends B too, not the ring's B/2; headers add a few hundred.
    for rank in ranks:
        if rank["written"]["all_reduce"] is None:
            pytest.skip("no /proc/self/io here: bytes_written is None off Linux")
        for name in ("all_reduce", "reduce_scatter"):
            assert 32768 <= rank["written"][name] <= 32768 + 1024, (name, rank["written"])


def test_bytes_written_is_none_without_proc(monkeypatch) -> None:
    import builtins

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert traffic.bytes_written() is None


def test_socket_writes_leaves_out_what_is_printed_and_relays_it(capfd) -> None:
    import os
    import sys

    if traffic.bytes_written() is None:
        pytest.skip("no /proc/self/io here: SocketWrites.nbytes is None off Linux")
    with traffic.SocketWrites() as written:
        print("o" * 4999)
        os.write(2, b"e" * 3000)  # below Python, as a C++ warning writes
    assert written.nbytes == 0  # no socket here: nothing but what was printed
    out, err = capfd.readouterr()
    assert out == "o" * 4999 + "\n" and err == "e" * 3000
    assert sys.stdout is not None


def test_socket_writes_is_none_without_proc(monkeypatch) -> None:
    from mgtutor.measure import written

    monkeypatch.setattr(written, "bytes_written", lambda: None)
    with traffic.SocketWrites() as socket_writes:
        pass
    assert socket_writes.nbytes is None
