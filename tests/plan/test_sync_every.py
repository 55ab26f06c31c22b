"""planner: LocalSGD and DiLoCo (``method``, ``sync_every``) by hand from the parameter count.

What they do is torchft 0.2.0's ``torchft/local_sgd.py``: one all-reduce of a parameter-sized
float32 buffer every H steps; the clones it all-reduces are held on the GPU during the sync;
DiLoCo's anchor lives on the CPU (its default ``backup_device``), its outer momentum on the GPU.
"""

from __future__ import annotations

import pytest

from mgtutor.plan.local_sync import METHODS, method_refusal, sync_memory
from mgtutor.plan.machine import H100_SXM_NODE
from mgtutor.plan.planner import layouts, plan
from mgtutor.plan.shape import Transformer
from mgtutor.plan.step_time import step_time

GB = 10**9
P = 3 * 2**20  # parameters: every division below is exact
N = 8  # data-parallel GPUs


def count(params: int) -> Transformer:
    """A model given by its parameter count: one layer holds them all (no embedding)."""
    return Transformer(layers=1, hidden=1, heads=1, seq_len=1, params=params)


@pytest.mark.parametrize("method", ["localsgd", "diloco"])
@pytest.mark.parametrize("h", [1, 8, 64])
def test_one_float32_all_reduce_of_the_parameters_every_h_steps(method, h):
    ring = 2 * (N - 1) * 4 * P // N  # a ring all-reduce of P float32 values, per GPU
    got = plan(count(P), N, 80 * GB, method=method, sync_every=h)
    assert got.sent_bytes * h == ring
    # Against DDP's own plan: float32 gradients are the same buffer, sent every step.
    assert got.sent_bytes == plan(count(P), N, 80 * GB, precision="fp32").sent_bytes // h
    # Mixed precision: DDP sends 16-bit gradients; the replicas average float32 weights.
    assert got.sent_bytes * h == 2 * plan(count(P), N, 80 * GB).sent_bytes
    (collective,) = got.collectives
    assert (collective.name, collective.calls, collective.every) == ("all_reduce", 1, h)
    assert collective.buffer_bytes == 4 * P


def test_memory_beside_ddp_by_hand():
    ddp = plan(count(P), N, 80 * GB)
    localsgd = plan(count(P), N, 80 * GB, method="localsgd", sync_every=8)
    diloco = plan(count(P), N, 80 * GB, method="diloco", sync_every=8)
    # LocalSGD: the float32 clones it all-reduces, during the sync.
    assert localsgd.total - ddp.total == localsgd.memory["communication"] == 4 * P
    # DiLoCo: pseudo-gradients and the local parameters' copy (sync), the outer momentum; the
    # anchor is on the CPU.
    assert diloco.memory["communication"] == 8 * P
    assert diloco.memory["optimizer_state"] - ddp.memory["optimizer_state"] == 4 * P
    assert diloco.total - ddp.total == 12 * P
    assert diloco.model_states == ddp.model_states + 4 * P


def test_layout_names_the_method_and_h():
    got = plan(count(P), N, 80 * GB, method="diloco", sync_every=8)
    assert got.layout == "dp=8 (DiLoCo, H=8) x tp=1 x pp=1"
    assert plan(count(P), N, 80 * GB, method="localsgd", sync_every=4).layout.startswith(
        "dp=8 (LocalSGD, H=4)"
    )


def test_one_replica_sends_nothing():
    assert plan(count(P), 1, 80 * GB, method="localsgd", sync_every=8).sent_bytes == 0


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("method", ["localsgd", "diloco"])
def test_zero_with_localsgd_or_diloco_is_refused(method, zero):
    with pytest.raises(ValueError, match=f"zero={zero}"):
        plan(count(P), N, 80 * GB, method=method, sync_every=8, zero=zero)


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"method": "local_sgd"}, "localsgd"),  # the choices are named
        ({"method": "ddp", "sync_every": 8}, "micro_batches"),
        ({"method": "diloco", "sync_every": 0}, "at least 1"),
    ],
)
def test_misspelt_method_and_wrong_sync_every_raise(options, word):
    with pytest.raises(ValueError, match=word):
        plan(count(P), N, 80 * GB, **options)


def test_layouts_try_zero_0_only_for_diloco():
    model = Transformer(layers=32, hidden=4096, heads=32, seq_len=4096)
    found = layouts(model, 8, 80 * GB, recompute="selective", micro_batches=8, method="diloco",
                    sync_every=8)
    assert found and {(p.zero, p.method, p.sync_every) for p in found} == {(0, "diloco", 8)}
    ddp = {p.layout for p in layouts(model, 8, 80 * GB, zero=(0,), recompute="selective",
                                     micro_batches=8)}
    # DiLoCo holds 12 bytes a parameter more (momentum, sync buffers): two of DDP's layouts
    # that fit no longer do (with the sync's memory not counted, none drops out).
    dropped = ddp - {p.layout.replace(" (DiLoCo, H=8)", "") for p in found}
    assert dropped == {"dp=4 x tp=1 x pp=2", "dp=4 x tp=2 x pp=1"}, dropped


def test_step_time_refuses_what_it_does_not_model():
    model = Transformer(layers=2, hidden=64, heads=2, seq_len=16)
    with pytest.raises(ValueError, match="every 8 steps"):
        step_time(plan(model, 8, 80 * GB, method="localsgd", sync_every=8), H100_SXM_NODE)


def test_sync_memory_and_method_refusal_directly():
    assert sync_memory("ddp", P) == {}
    assert sync_memory("localsgd", P) == {"communication": 4 * P}
    assert sync_memory("diloco", P) == {"communication": 8 * P, "optimizer_state": 4 * P}
    assert all(method_refusal(method=m, zero=0, sync_every=8 if m != "ddp" else 1) is None
               for m in METHODS)
